"""`Zero`: a module plus an optimizer whose model states are sharded over a group.
Follows ZeRO (Rajbhandari et al. 2019, arXiv 1910.02054) and DeepSpeed's engine API.

Who talks to whom: the training loop calls Zero/ZeroOptimizer; they drive the engine
(flat.py or stage3.py), which calls comm.py on `group`; mixed.py holds the masters.

More (the design and its reasons): docs/design/zero.md, "Notes from parallel/zero/api.py".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from disttrain.comm.buckets import mb_to_bytes
from disttrain.comm.collectives import broadcast_tensors
from disttrain.comm.reducer import check_algorithm
from disttrain.parallel.zero import checkpoint as ckpt
from disttrain.parallel.zero import comm, groups, mixed
from disttrain.parallel.zero.flat import FlatShards
from disttrain.parallel.zero.optimizer import ShardLayout, ZeroOptimizer, state_tensors
from disttrain.parallel.zero.stage3 import ParamShards

__all__ = ["Zero", "ZeroOptimizer"]

OptimizerFactory = Callable[[list], torch.optim.Optimizer]


class Zero(nn.Module):
    """Shard `module`'s model states over `group` (ZeRO `stage` 0-3).

    stage: 0 plain data parallelism (all-reduce; nothing sharded), 1 optimizer state,
        2 + gradients, 3 + parameters.
    optimizer_factory: `params -> torch.optim.Optimizer`, called once with this rank's
        flat shard parameters (fp32 masters in mixed precision), or with torch param
        groups `[{"params": [...], **options}, ...]` when `param_groups` is given.
    group: process group to shard over (None = all ranks; e.g. a mesh's dp group).
    bucket_mb: gradient bucket size in MiB for stages 0-2 (stage 3 buckets by layer).
    precision: "fp32" (default), "bf16" or "fp16": the module (parameters, buffers and
        floating inputs) runs in that precision, gradients are reduced in it, and the
        optimizer steps fp32 masters of this rank's shard (mixed.py).
    loss_scaler: fp16 only: a `LossScaler` (dynamic; default LossScaler()).
    param_groups: per-parameter optimizer options by name (groups.py): a function
        (name, param) -> options, or a list of {"params": [names], **options}.
    reduce_dtype: dtype gradients are reduced (and the shard gradients kept) in; None:
        the parameters' (the low precision). torch.float32 under bf16/fp16.
    overflow_group: fp16: the group whose ranks vote on overflow together (default
        `group`); it must contain `group` (e.g. the world, for pipeline/tensor parallel).
    separate: parameters that get a flat buffer (stage 3: a unit) of their own, so every
        group of the same size shards them at the same offsets (parallelize: weights
        tied across pipeline stages; `separate_grad(p)` then gives their shard gradient).
    algorithm: how gradient buckets are reduced. Stage 0 all-reduces: "native" (the
        backend's own, default), "ring", "halving-doubling", "tree", "hierarchical" or
        "auto" (comm/algorithms.py; buckets still overlap backward). Stages 1-2
        reduce-scatter: "native" or "ring". Stage 3: "native" only.
    broadcast_buffers: re-broadcast buffers (BatchNorm running statistics) from group rank
        0 before each training forward, as DataParallel and DDP do (default True).
    whole_modules: stage 3: module classes whose forward reads their submodules'
        parameters directly; each such module is one unit gathered at its own forward
        (nn.MultiheadAttention always is; units.py).

    Construction blocks (parameters and buffers are broadcast from group rank 0).
    `model.optimizer.step()` blocks until the step's collectives are done.
    """

    def __init__(self, module: nn.Module, optimizer_factory: OptimizerFactory, stage: int = 2,
                 group: dist.ProcessGroup | None = None, bucket_mb: float = 25.0, *,
                 precision: str = "fp32", loss_scaler: mixed.LossScaler | None = None,
                 param_groups: groups.ParamGroups = None,
                 reduce_dtype: torch.dtype | None = None, overflow_group: Any = "group",
                 separate: Iterable[nn.Parameter] = (), algorithm: str = "native",
                 broadcast_buffers: bool = True,
                 whole_modules: Iterable[type[nn.Module]] = ()):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"Zero wraps an nn.Module, got {type(module).__name__}")
        _check_stage(stage, whole_modules)
        _check_arguments(optimizer_factory, precision, loss_scaler)
        self.dtype = mixed.low_dtype(precision)
        _check_reduce_dtype(reduce_dtype, precision)
        self.algorithm = _check_algorithm(algorithm, stage)
        if not dist.is_initialized():
            raise RuntimeError("Zero needs a process group: call disttrain.init() first")
        if dist.get_rank(group) < 0:
            raise ValueError(f"rank {dist.get_rank()} is not a member of the group it was given")
        self.module, self.stage, self.group, self.precision = module, stage, group, precision
        self.broadcast_buffers = broadcast_buffers
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.overflow_group = group if isinstance(overflow_group, str) else overflow_group
        if dist.get_rank(self.overflow_group) < 0:
            raise ValueError(f"rank {dist.get_rank()} is not a member of overflow_group; pass "
                             "a group holding every rank of `group` (e.g. None: the world)")
        self.reduce_dtype = reduce_dtype
        self.comm_stats = comm.CommStats()
        params = _unique(p for p in module.parameters() if p.requires_grad)
        if not params:
            raise ValueError("Zero: the module has no parameter that requires grad; wrap the model "
                             "being trained (a frozen model has no optimizer state to shard)")
        group_of, options = groups.assign_groups(module, params, param_groups)
        if self.dtype is not None:
            module.to(self.dtype)  # NOTE: in place: parameters keep their identity
        _broadcast_module(module, group, self.comm_stats)
        self.param_names = {id(p): n for n, p in module.named_parameters()}  # before stage 3
        self.param_shapes = {id(p): p.shape for p in params}
        own = {id(p) for p in separate}
        if stage == 3:
            self.engine = ParamShards(module, group, self.comm_stats, group_of, reduce_dtype, own,
                                      tuple(whole_modules))
        else:
            self.engine = FlatShards(params, stage, group, mb_to_bytes(bucket_mb), self.comm_stats,
                                     group_of, reduce_dtype, own, algorithm)
        shards = self.engine.shard_parameters()
        self.masters = mixed.MasterWeights(shards) if self.dtype is not None else None
        stepped = self.masters.masters if self.masters is not None else shards
        inner = _build_optimizer(optimizer_factory, stepped, self.engine.shard_groups(),
                                 options if param_groups is not None else None)
        scaler = (loss_scaler or mixed.LossScaler()) if precision == "fp16" else None
        # NOTE: one dict, shared with the optimizer's layout: tied weights across pipeline
        # stages rename their state in place (pipeline/tied.py).
        self.state_names = dict(self.param_names)
        layout = ShardLayout(self.engine, self.masters, stage, self.rank, self.world, precision,
                             group, self.overflow_group, self.comm_stats, self.state_names)
        self.optimizer = ZeroOptimizer(layout, inner, scaler)

    whole_weight_backward = True
    """A pipeline's split backward runs this module's W as one autograd run: stages 0-2
    reduce gradients in hooks that end a step per backward (pipeline/split_backward.py)."""

    @property
    def split_backward_refusal(self) -> str | None:
        """Why a split backward does not run over this module (stage 3), else None."""
        if self.stage != 3:
            return None
        return ("schedule 'zb-h1' (split backward) is not supported with ZeRO stage 3, whose "
                "parameters are flat units gathered around forward and backward (W has no "
                "Parameters to run on); use zero=1 or 2, or schedule='1f1b'")

    def forward(self, *args, **kwargs):
        buffers = list(self.module.buffers()) if self.broadcast_buffers else []
        if buffers and self.training and torch.is_grad_enabled():
            broadcast_tensors(buffers, 0, self.group)  # NOTE: as DDP; blocks
        if self.dtype is not None:  # floating inputs follow the module (FSDP's cast_forward_inputs)
            args, kwargs = tree_map(self._cast, (args, kwargs))
        check = self.engine.read_check() if self.stage == 3 else None
        if check is None:
            return self.module(*args, **kwargs)
        with check:  # the first forward at stage 3 (units.py)
            return self.module(*args, **kwargs)

    def _cast(self, x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != self.dtype:
            return x.to(self.dtype)
        return x

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`, scaled in fp16 (DeepSpeed's engine.backward). Blocks."""
        self.optimizer.backward(loss)

    def separate_grad(self, p: nn.Parameter) -> torch.Tensor:
        """This rank's shard of the (dp-summed, not yet averaged) gradient of `p`, a
        parameter given in `separate`, in place: changing it changes what is stepped.
        Blocks (waits for this step's reductions)."""
        return self.engine.separate_grad(p)

    def fp32_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 parameters by name: the masters in mixed precision, else the
        parameters (DeepSpeed's zero_to_fp32). Blocks at stages 1-3: every rank calls it."""
        shards = self.masters.masters if self.masters is not None else \
            self.engine.shard_parameters()
        return ckpt.full_flat(shards, self.engine.segments(), self.param_shapes,
                              self.param_names, self.group, self.comm_stats, self.stage > 0)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget this rank's gradients (waits for reductions still in flight)."""
        self.optimizer.zero_grad()

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Tensors this rank keeps: params, grads, optimizer state (for disttrain.memory)."""
        held = dict(self.engine.held())
        held["optimizer"] = state_tensors(self.optimizer.inner)
        if self.masters is not None:  # the paper counts the fp32 master in K
            held["optimizer"] += [m.detach() for m in self.masters.masters]
        return held

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """The wrapped module's full state dict, same keys as unwrapped.

        Stage 3 all-gathers every layer (blocks; every rank must call it).
        """
        sd = self.module.state_dict(*args, **kwargs)
        if self.stage == 3:
            sd.update(self.engine.full_tensors())
        return sd

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign=False):
        """Load a full (unwrapped-module) state dict on every rank; each keeps its shard."""
        if self.stage != 3:
            result = self.module.load_state_dict(state_dict, strict=strict)
        else:
            result = self._load_stage3(state_dict, strict)
        if self.masters is not None:  # NOTE: masters follow the loaded parameters
            self.masters.copy_up()
        return result

    def _load_stage3(self, state_dict, strict):
        names = {key for key, *_ in self.engine.names}
        missing = sorted(names - set(state_dict))
        if strict and missing:
            raise KeyError(f"state dict lacks parameters {missing[:5]}; was it saved from "
                           "this model's Zero(...).state_dict() or the plain module?")
        rest = {k: v for k, v in state_dict.items() if k not in names}
        result = self.module.load_state_dict(rest, strict=False)
        if strict and result.unexpected_keys:
            raise KeyError(f"unexpected keys in state dict: {result.unexpected_keys[:5]}")
        self.engine.load_full({k: v for k, v in state_dict.items() if k in names})
        return result


def _check_stage(stage: int, whole_modules) -> None:
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if whole_modules and stage != 3:
        raise ValueError(f"whole_modules chooses stage 3's units; stage {stage} has none "
                         "(drop it, or use stage=3)")


def _check_arguments(optimizer_factory, precision: str, loss_scaler) -> None:
    """Bad arguments, before any communication or change to the module."""
    if not callable(optimizer_factory) or isinstance(optimizer_factory, torch.optim.Optimizer):
        raise TypeError("optimizer_factory must be a function params -> optimizer, e.g. "
                        "lambda ps: torch.optim.AdamW(ps, lr=1e-3); not an optimizer")
    mixed.low_dtype(precision)
    if loss_scaler is not None and precision != "fp16":
        raise ValueError(f"loss_scaler applies to precision='fp16' only, not {precision!r} "
                         "(bf16 has fp32's exponent range and needs no scaling); drop it")
    if loss_scaler is not None and not isinstance(loss_scaler, mixed.LossScaler):
        raise TypeError("loss_scaler must be a disttrain.LossScaler(init_scale=..., ...), "
                        f"got {type(loss_scaler).__name__}")


def _check_algorithm(algorithm: str, stage: int) -> str:
    check_algorithm(algorithm, "Zero")
    if stage in (1, 2) and algorithm not in ("native", "ring"):
        raise ValueError(f"Zero: stage {stage} reduce-scatters gradients, which the backend "
                         f"('native') or a ring does, not {algorithm!r}: pass algorithm='ring' "
                         f"or 'native', or stage=0 to all-reduce with {algorithm!r}")
    if stage == 3 and algorithm != "native":
        raise ValueError(f"Zero: stage 3 reduce-scatters and gathers layer by layer with the "
                         f"backend's own collectives; algorithm={algorithm!r} applies to stages "
                         "0-2 (ring at 1-2): use algorithm='native' or a lower stage")
    return algorithm


def _check_reduce_dtype(reduce_dtype, precision: str) -> None:
    low = mixed.LOW_DTYPES[precision] or torch.float32
    if reduce_dtype is not None and reduce_dtype not in (torch.float32, low):
        raise ValueError(f"reduce_dtype must be None (reduce in the parameters' {low}) or "
                         f"torch.float32 with precision={precision!r}, got {reduce_dtype!r}")


def _build_optimizer(factory, stepped: list, where: list[int],
                     options: list[dict] | None) -> torch.optim.Optimizer:
    """factory(shards), or factory(torch param groups over the shards) with `options`."""
    if options is None:
        inner = factory(stepped)
    else:
        inner = factory([{"params": [s for s, g in zip(stepped, where) if g == gi], **opts}
                         for gi, opts in enumerate(options)])
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"optimizer_factory returned {type(inner).__name__}, "
                        "expected a torch.optim.Optimizer")
    return inner


def _unique(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    seen: set[int] = set()
    return [p for p in params if not (id(p) in seen or seen.add(id(p)))]


@torch.no_grad()
def _broadcast_module(module: nn.Module, group, stats: comm.CommStats) -> None:
    """Make every rank's parameters and buffers equal to group rank 0's (blocks)."""
    tensors = _unique(list(module.parameters()) + list(module.buffers()))
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for members in by_kind.values():
        flat = torch.cat([t.detach().reshape(-1) for t in members])  # (sum numel,)
        comm.broadcast(flat, group, stats)
        offset = 0
        for t in members:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
