"""Catch NaN/inf gradients at their source: which parameter, on which rank.

Data parallelism averages gradients, so one rank's NaN becomes every rank's NaN and the
loss curve says nothing about where it came from. `FiniteGradCheck(model)` hooks every
parameter's *local* gradient (a tensor hook runs before accumulation, so before
DataParallel's or ZeRO's reduction), keeps one "saw NaN/inf" flag per parameter as a
tensor (no host sync in the hook), and `check()` gathers the flags of every rank with one
small all_reduce and raises `NonFiniteGradError` on every rank, naming the parameters
and ranks, so all ranks stop together instead of one raising while the others hang.

Cost when on: one isfinite() pass over each gradient plus, per `check()`, one all_reduce
of world x P bytes. Works with any wrapper (DataParallel, Zero, tensor-parallel layers).

Who talks to whom: torch autograd calls the hooks; `check()` calls disttrain.comm.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from disttrain import comm

__all__ = ["FiniteGradCheck", "NonFiniteGradError"]

FIXES = ("lower the learning rate, clip gradients (torch.nn.utils.clip_grad_norm_), check that "
         "rank's batch for NaN/inf inputs or labels, or use a loss scaler with fp16")


class NonFiniteGradError(FloatingPointError):
    """Some rank computed a NaN or inf gradient; `.bad` maps rank -> parameter names."""

    def __init__(self, message: str, bad: dict[int, list[str]]):
        super().__init__(message)
        self.bad = bad


class FiniteGradCheck:
    """Watch `module`'s gradients for NaN/inf; `check()` raises naming parameter and rank.

    Every rank of `group` (None: the world, or a world of one without a process
    group) must call `check()` at the same point, e.g. after `loss.backward()`.
    """

    def __init__(self, module: nn.Module, group=None):
        if not isinstance(module, nn.Module):
            raise TypeError(f"FiniteGradCheck watches an nn.Module, got {type(module).__name__}; "
                            "pass the model (or the DataParallel/Zero wrapper around it)")
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("FiniteGradCheck: the module has no parameter that requires grad; "
                             "pass the model being trained")
        self.names = [n for n, _ in named]
        self.group = group
        self._bad = torch.zeros(len(named), dtype=torch.bool, device=named[0][1].device)
        self._hooks = [p.register_hook(self._watch(i)) for i, (_, p) in enumerate(named)]

    def _watch(self, i: int):
        def hook(grad: torch.Tensor) -> None:
            # NOTE: a tensor op, not `if`: no host sync inside backward.
            self._bad[i] |= ~torch.isfinite(grad).all().to(self._bad.device)
        return hook

    def check(self) -> None:
        """Raise NonFiniteGradError on every rank if any rank saw NaN/inf since the last check.

        Blocks: one all_reduce over the group (none in a world of one). Resets the flags.
        """
        if dist.is_initialized():
            world, me = dist.get_world_size(self.group), dist.get_rank(self.group)
        else:
            world, me = 1, 0
        flags = torch.zeros(world, len(self.names), dtype=torch.int32, device=self._bad.device)
        flags[me] = self._bad.to(torch.int32)  # (world, P): row r = rank r's flags
        self._bad.zero_()
        if world > 1:
            comm.all_reduce(flags, group=self.group)
        if not bool(flags.any()):
            return
        bad = {r: [self.names[i] for i in flags[r].nonzero().flatten().tolist()]
               for r in range(world) if flags[r].any()}
        ranks = self._global_ranks(list(bad))
        said = "; ".join(f"rank {ranks[r]}: {', '.join(names[:8])}"
                         + (f" and {len(names) - 8} more" if len(names) > 8 else "")
                         for r, names in bad.items())
        raise NonFiniteGradError(f"non-finite (NaN or inf) gradients before averaging: {said}. "
                                 f"To fix: {FIXES}", {ranks[r]: n for r, n in bad.items()})

    def _global_ranks(self, group_ranks: list[int]) -> dict[int, int]:
        if self.group is None or not dist.is_initialized():
            return {r: r for r in group_ranks}
        return {r: dist.get_global_rank(self.group, r) for r in group_ranks}

    def remove(self) -> None:
        """Unhook from the parameters (never blocks)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
