"""`Parallelism`: how `parallelize` shards a model, besides the mesh and the TP plan.

One dataclass, a docstring per field, every cross-field rule checked in `__post_init__`
(as torchtitan's job config and ParallelDims), so a wrong combination fails before any
process group is touched. `parallelize` reads it; the steps it calls take plain values.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from disttrain.comm.reducer import check_algorithm
from disttrain.parallel.pipeline.schedules import SCHEDULES

__all__ = ["Parallelism"]

PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass
class Parallelism:
    """Options of `parallelize(model, mesh, plan, config)`; defaults train fp32 with 1F1B."""

    schedule: str = "1f1b"
    """Pipeline schedule when pp > 1: "gpipe", "1f1b", "interleaved" or "zb-h1"."""
    microbatches: int = 1
    """Micro-batches each batch is cut into for the pipeline."""
    num_virtual: int = 1
    """Model chunks per pipeline stage (>= 2 with "interleaved", else 1)."""
    zero: int = 0
    """0: DataParallel over dp; 1-3: that ZeRO stage over dp (needs optimizer_factory)."""
    optimizer_factory: Callable | None = None
    """params -> torch optimizer; becomes `model.optimizer` (ZeRO: over this rank's shard)."""
    precision: str = "fp32"
    """"bf16"/"fp16": ZeRO mixed precision (low-precision module, fp32 masters); zero >= 1."""
    loss_scaler: Any = None
    """fp16 only: a `disttrain.LossScaler` (default: a dynamic one); each chunk gets a copy."""
    reduce_dtype: torch.dtype | None = None
    """ZeRO mixed precision: reduce gradients in this dtype (default: the module's)."""
    param_groups: Any = None
    """ZeRO: per-parameter optimizer options (see `disttrain.Zero`)."""
    bucket_mb: float | str = 25.0
    """Gradient bucket size in MB for the dp reduction ("auto" with DataParallel)."""
    compression: Any = None
    """DataParallel only: "fp16", "bf16" or a Compression object for the dp all-reduce."""
    algorithm: str = "native"
    """How the dp gradient buckets are reduced. zero=0 (DataParallel) all-reduces:
    "native" (the backend's own), "ring", "halving-doubling", "tree", "hierarchical" or
    "auto" (disttrain.comm.algorithms). zero=1-2 reduce-scatter: "native" or "ring".
    zero=3: "native"."""
    find_unused: bool = False
    """DataParallel only: allow parameters that get no gradient in a step."""
    check_finite: bool = False
    """DataParallel only: raise, naming parameter and rank, on a NaN/inf local gradient."""
    broadcast_buffers: bool = True
    """DataParallel and ZeRO: copy dp rank 0's buffers (BatchNorm running statistics) to the
    other replicas before each training forward, as DDP does."""
    sync_batchnorm: bool = False
    """Convert the model's BatchNorm layers to `disttrain.SyncBatchNorm` over the dp group
    (batch statistics of the whole global batch), before anything else."""
    loss_fn: Callable | None = None
    """loss(output, target) on the last stage; default token cross-entropy (vocab-parallel
    over tp when tp > 1). Return the plain fp32 loss: under fp16 parallelize scales it."""
    layers: list[str] | None = None
    """Names of the layers a pipeline may cut between, in forward order (default:
    `model.pipeline_layers()`, or for a traced model its largest run of repeated blocks)."""
    example: tuple | None = None
    """(inputs, targets) of one train_step batch (this dp replica's share): a model without
    `pipeline_layers()` is pipelined by tracing it on one micro-batch of it."""
    costs: list[float] | None = None
    """One cost per layer for balancing stages (default: parameter counts)."""
    recompute: bool | list[str] = False
    """True (the model's `recompute_layers()`) or module names/globs to recompute in backward."""
    sequence_parallel: bool = False
    """With tp > 1: Megatron sequence parallelism for the plan's "sequence*" entries."""
    tied: list[list[str]] | None = None
    """Sets of parameter names sharing one weight (default: `model.tied_parameters()` or
    the Parameters the model holds under several names)."""
    track_memory: bool = False
    """Record bytes saved for backward per pipeline action (pipeline.meter)."""

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        for name in ("microbatches", "num_virtual"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero must be 0 (DataParallel) or a ZeRO stage 1, 2 or 3; got {self.zero!r}")
        if self.zero and self.optimizer_factory is None:
            raise ValueError(f"zero={self.zero} shards the optimizer state, so parallelize builds "
                             "the optimizer: pass optimizer_factory=lambda ps: torch.optim.AdamW(ps, "
                             "lr=...) and step model.optimizer")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        zero_only = {"precision": self.precision != "fp32", "loss_scaler": self.loss_scaler is not None,
                     "reduce_dtype": self.reduce_dtype is not None,
                     "param_groups": self.param_groups is not None}
        for name, used in zero_only.items():
            if used and not self.zero:
                raise ValueError(f"{name} is a ZeRO option: add zero=1, 2 or 3 (mixed precision "
                                 "keeps fp32 masters in ZeRO's sharded optimizer state)")
        check_algorithm(self.algorithm, "Parallelism")
        if self.zero and self.algorithm not in ("native", "ring") or \
                self.zero == 3 and self.algorithm != "native":
            raise ValueError(f"algorithm={self.algorithm!r} with zero={self.zero}: ZeRO stages 1-2 "
                             "reduce-scatter gradients ('native' or 'ring'), stage 3 takes "
                             "'native' only; the other algorithms all-reduce (zero=0)")
        dp_only = {"compression": self.compression is not None, "find_unused": self.find_unused,
                   "check_finite": self.check_finite}
        for name, used in dp_only.items():
            if used and self.zero:
                raise ValueError(f"{name} is a DataParallel option; ZeRO (zero={self.zero}) does "
                                 f"not take it: drop {name} or use zero=0")
        if self.loss_scaler is not None and self.precision != "fp16":
            raise ValueError("loss_scaler needs precision='fp16' (bf16 and fp32 need no scaling)")
        if self.sequence_parallel and self.zero == 3:
            raise ValueError("sequence_parallel sums LayerNorm gradients over tp in hooks on the "
                             "Parameters, which ZeRO stage 3 replaces by flat units; use zero=1 "
                             "or 2 with sequence_parallel, or sequence_parallel=False")

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> Parallelism:
        """The config from `parallelize`'s keyword shorthand. `dp_options` (a dict of
        DataParallel/Zero keywords) is deprecated: its keys are fields, pass them as
        keywords; it still works, with a DeprecationWarning, for one release."""
        options = dict(options)
        known = {f.name for f in fields(cls)}
        if "dp_options" in options:
            legacy = options.pop("dp_options") or {}
            warnings.warn(f"parallelize(dp_options={legacy!r}) is deprecated: pass its keys as "
                          f"keyword options or Parallelism fields, e.g. parallelize(..., "
                          f"{', '.join(f'{k}=...' for k in legacy) or 'precision=...'})",
                          DeprecationWarning, stacklevel=3)
            options = {**legacy, **options}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"parallelize got unknown option(s) {unknown}; the options are the "
                            f"fields of disttrain.Parallelism: {', '.join(sorted(known))}")
        return cls(**options)

    def example_microbatch(self) -> tuple | None:
        """One micro-batch of `example` (what `split_stages` traces on), or None."""
        if self.example is None:
            return None
        return tuple(t.chunk(self.microbatches)[0] for t in self.example)

    def data_parallel_keywords(self) -> dict[str, Any]:
        """Keywords for `apply_data_parallel`: the one place where the config's ZeRO stage
        picks the wrapper's options (zero=0: DataParallel's; 1-3: Zero's and the factory)."""
        if not self.zero:
            return self.data_parallel_options()
        return {"zero": self.zero, "optimizer_factory": self.optimizer_factory,
                **self.zero_options()}

    def data_parallel_options(self) -> dict[str, Any]:
        """Keywords for `DataParallel` (zero=0)."""
        return {"bucket_mb": self.bucket_mb, "compression": self.compression,
                "find_unused": self.find_unused, "check_finite": self.check_finite,
                "algorithm": self.algorithm, "broadcast_buffers": self.broadcast_buffers}

    def zero_options(self) -> dict[str, Any]:
        """Keywords for `Zero` (zero >= 1), besides the group and the tied copies."""
        return {"bucket_mb": self.bucket_mb, "precision": self.precision,
                "loss_scaler": self.loss_scaler, "reduce_dtype": self.reduce_dtype,
                "param_groups": self.param_groups, "broadcast_buffers": self.broadcast_buffers,
                "algorithm": self.algorithm}
