"""ZeRO mixed precision: fp32 master shards and a dynamic loss scaler.

The recipe of Micikevicius et al. 2018 ("Mixed Precision Training", arXiv 1710.03740)
as ZeRO uses it (Rajbhandari et al. 2019, sec. 3.1) and DeepSpeed implements it: bf16 or
fp16 parameters and gradients, an fp32 master copy of this rank's shard that the
optimizer steps. One step: to_master (master.grad = shard.grad / scale), found_inf
(fp16: one all-reduce so every rank skips or steps alike), step or skip, copy_down
(shard <- master, then the engine all-gathers at stages 1-2). `LossScaler` is
DeepSpeed's DynamicLossScaler / torch GradScaler without hysteresis (2**16, x2 after
1000 clean steps, x0.5 on overflow). Details: docs/design/zero.md, "Mixed precision".

Who talks to whom: api.ZeroOptimizer owns a `MasterWeights` and a `LossScaler`; the
overflow vote goes through comm.py on the overflow group (default: the ZeRO group;
under parallelize the whole job).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from disttrain.parallel.zero import comm

__all__ = ["LOW_DTYPES", "LossScaler", "MasterWeights", "low_dtype"]

LOW_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""precision name -> dtype of the module's parameters and gradients (None: plain fp32)."""


def low_dtype(precision: str) -> torch.dtype | None:
    """The module dtype of `precision`; ValueError naming the choices otherwise."""
    if precision not in LOW_DTYPES:
        raise ValueError(f"precision must be one of {sorted(LOW_DTYPES)} (fp32: no master copy; "
                         f"bf16/fp16: low-precision module, fp32 master), got {precision!r}")
    return LOW_DTYPES[precision]


@dataclass
class LossScaler:
    """Dynamic loss scale for fp16 (DeepSpeed `fp16.loss_scale=0`; torch GradScaler).

    init_scale: first scale (DeepSpeed: 2**initial_scale_power, 2**16).
    growth_factor / growth_interval: scale *= growth_factor after that many steps in a row
        without overflow (DeepSpeed's loss_scale_window, 1000).
    backoff_factor: scale *= backoff_factor when a step overflowed (and is skipped).
    min_scale: the scale never goes below this.
    `scale`, `growth_tracker` and `skipped` are the live state (saved in checkpoints).
    """

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    min_scale: float = 1.0

    def __post_init__(self):
        if not (math.isfinite(self.init_scale) and self.init_scale > 0):
            raise ValueError(f"LossScaler init_scale must be a finite number > 0 (e.g. 2**16), "
                             f"got {self.init_scale!r}")
        if not self.growth_factor >= 1:
            raise ValueError(f"LossScaler growth_factor must be >= 1 (e.g. 2.0), "
                             f"got {self.growth_factor!r}")
        if not 0 < self.backoff_factor < 1:
            raise ValueError(f"LossScaler backoff_factor must be in (0, 1) (e.g. 0.5), "
                             f"got {self.backoff_factor!r}")
        if isinstance(self.growth_interval, bool) or not isinstance(self.growth_interval, int) \
                or self.growth_interval < 1:
            raise ValueError(f"LossScaler growth_interval must be an int >= 1 (steps), "
                             f"got {self.growth_interval!r}")
        if not 0 < self.min_scale <= self.init_scale:
            raise ValueError(f"LossScaler min_scale must be in (0, init_scale], "
                             f"got {self.min_scale!r}")
        self.scale = float(self.init_scale)
        self.growth_tracker = 0  # overflow-free steps since the last change
        self.skipped = 0  # steps skipped because of an overflow, in all

    def update(self, found_inf: bool) -> None:
        """After a step: back off (skipped step) or count towards growth. Pure."""
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.growth_tracker = 0
            self.skipped += 1
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"scale", "growth_tracker"} - set(state)
        if missing:
            raise ValueError(f"loss scaler state lacks {sorted(missing)}; was it saved with "
                             "precision='fp16'?")
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.skipped = int(state.get("skipped", 0))


class MasterWeights:
    """fp32 master copies of this rank's low-precision shard parameters (no comm here)."""

    def __init__(self, shards: list[nn.Parameter]):
        self.shards = shards
        # (S,) fp32 each: what the optimizer updates; a DeepSpeed-style copy of the
        # (already cast) low-precision shard. NOTE: built only for precision bf16/fp16
        # (Zero casts the module to it first), so .float() widens, never lowers
        self.masters = [nn.Parameter(s.detach().float().clone()) for s in shards]

    @torch.no_grad()
    def to_master(self, grads: list[torch.Tensor | None], divisor: float) -> None:
        """master.grad = grads[i] (the shards' reduced gradients) in fp32 / divisor."""
        for g, m in zip(grads, self.masters):
            # NOTE: a copy even when g is fp32 (reduce_dtype): never the engine's buffer
            m.grad = None if g is None else g.to(torch.float32, copy=True).div_(divisor)

    def local_inf(self) -> bool:
        """Whether this rank's master gradients hold an inf/nan (no communication)."""
        bad = [torch.logical_not(m.grad.isfinite().all()) for m in self.masters
               if m.grad is not None]
        return bool(torch.stack(bad).any()) if bad else False

    def found_inf(self, group, stats: comm.CommStats) -> bool:
        """Whether any rank's master gradient holds inf/nan (blocks: one all-reduce)."""
        return vote(self.local_inf(), group, stats, self.masters[0].device)

    @torch.no_grad()
    def copy_down(self) -> None:
        """shard <- master, cast to the low precision (this rank's chunk only)."""
        torch._foreach_copy_(self.shards, self.masters)  # one kernel group, not one per shard

    @torch.no_grad()
    def copy_up(self) -> None:
        """master <- shard (after the low-precision parameters were loaded)."""
        for s, m in zip(self.shards, self.masters):
            m.copy_(s)

    def drop_grads(self) -> None:
        for m in self.masters:
            m.grad = None


@torch.no_grad()
def vote(local: bool, group, stats: comm.CommStats, device=None) -> bool:
    """Whether any rank of `group` saw an overflow (blocks: one 4-byte all-reduce).

    NOTE: every rank of `group` must call it once per step (same decision everywhere)."""
    flag = torch.tensor([float(local)], device=device)
    comm.all_reduce(flag, group, stats)
    return bool(flag.item() > 0)


def accumulate_shard_grad(holder: Any, out: torch.Tensor, reduce_dtype: torch.dtype | None) -> None:
    """Add a reduced shard gradient `out` to a bucket or unit (`holder.shard`, `holder.rgrad`).

    With `reduce_dtype` it goes beside the shard (`holder.rgrad`): a Parameter's `.grad`
    must have the parameter's dtype. Otherwise into `holder.shard.grad`.
    """
    if reduce_dtype is not None:
        holder.rgrad = out if holder.rgrad is None else holder.rgrad.add_(out)
    elif holder.shard.grad is None:
        holder.shard.grad = out
    else:
        holder.shard.grad.add_(out)
