"""`Zero`: a module plus an optimizer whose model states are sharded over a group.

The user-facing wrapper of ZeRO (Rajbhandari et al. 2019, arXiv 1910.02054):

    model = disttrain.Zero(net, lambda ps: torch.optim.AdamW(ps, lr=3e-4), stage=2)
    opt = model.optimizer
    for x, y in loader:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

Stages 0-2 live in flat.py (full parameters, sharded optimizer state and gradients),
stage 3 in stage3.py (parameters sharded too). Any torch optimizer works: the factory
gets this rank's flat shard parameters (one per bucket or layer) and builds it over
them; element-wise optimizers (SGD, Adam, AdamW, RMSprop, Adagrad...) then give the
same result as unsharded training. Optimizers that look across elements (LAMB's
per-tensor trust ratio, LBFGS) would see flat shards, not tensors.

Who talks to whom: the training loop calls Zero/ZeroOptimizer; they drive the engine
(flat.py or stage3.py), which calls comm.py on `group`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from disttrain.comm.buckets import mb_to_bytes
from disttrain.parallel.zero import checkpoint as ckpt
from disttrain.parallel.zero import comm
from disttrain.parallel.zero.flat import FlatShards
from disttrain.parallel.zero.stage3 import ParamShards

__all__ = ["Zero", "ZeroOptimizer"]

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class Zero(nn.Module):
    """Shard `module`'s model states over `group` (ZeRO `stage` 0-3).

    stage: 0 plain data parallelism (allreduce; nothing sharded), 1 optimizer state,
        2 + gradients, 3 + parameters.
    optimizer_factory: `params -> torch.optim.Optimizer`, called once with this rank's
        flat shard parameters.
    group: process group to shard over (None = all ranks; e.g. a mesh's dp group).
    bucket_mb: gradient bucket size in MiB for stages 0-2 (stage 3 buckets by layer).

    Construction blocks (parameters and buffers are broadcast from group rank 0).
    `model.optimizer.step()` blocks until the step's collectives are done.
    """

    def __init__(self, module: nn.Module, optimizer_factory: OptimizerFactory, stage: int = 2,
                 group: dist.ProcessGroup | None = None, bucket_mb: float = 25.0):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"Zero wraps an nn.Module, got {type(module).__name__}")
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
        if not callable(optimizer_factory) or isinstance(optimizer_factory, torch.optim.Optimizer):
            raise TypeError("optimizer_factory must be a function params -> optimizer, e.g. "
                            "lambda ps: torch.optim.AdamW(ps, lr=1e-3); not an optimizer")
        if not dist.is_initialized():
            raise RuntimeError("Zero needs a process group: call disttrain.init() first")
        if dist.get_rank(group) < 0:
            raise ValueError(f"rank {dist.get_rank()} is not a member of the group it was given")
        self.module, self.stage, self.group = module, stage, group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.comm_stats = comm.CommStats()
        _broadcast_module(module, group, self.comm_stats)
        params = _unique(p for p in module.parameters() if p.requires_grad)
        self.param_names = {id(p): n for n, p in module.named_parameters()}  # before stage 3
        if not params:
            raise ValueError("Zero: the module has no parameter that requires grad; wrap the model "
                             "being trained (a frozen model has no optimizer state to shard)")
        if stage == 3:
            self.engine = ParamShards(module, group, self.comm_stats)
        else:
            self.engine = FlatShards(params, stage, group, mb_to_bytes(bucket_mb), self.comm_stats)
        inner = optimizer_factory(self.engine.shard_parameters())
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"optimizer_factory returned {type(inner).__name__}, "
                            "expected a torch.optim.Optimizer")
        self.optimizer = ZeroOptimizer(self, inner)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget this rank's gradients (waits for reductions still in flight)."""
        self.optimizer.zero_grad()

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Tensors this rank keeps: params, grads, optimizer state (for disttrain.memory)."""
        held = dict(self.engine.held())
        held["optimizer"] = _state_tensors(self.optimizer.inner)
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
            return self.module.load_state_dict(state_dict, strict=strict)
        names = {key for key, _, _ in self.engine.names}
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


class ZeroOptimizer:
    """This rank's optimizer over its shards, behind the torch.optim interface.

    `step()` waits for gradient reductions, averages, steps the inner optimizer and
    (stages 1-2) all-gathers the updated parameters: it blocks. `state_dict()` holds
    only this rank's shard of the state (stage >= 1), tagged with the layout, and
    `load_state_dict` refuses a state saved with another stage, world size or rank;
    `disttrain.Checkpointer` uses `sharded_state_dict()` instead, which reshards.
    LR schedulers attach to `.inner` (the real torch optimizer).
    """

    def __init__(self, owner: Zero, inner: torch.optim.Optimizer):
        self._owner, self.inner = owner, inner
        self._prepared = False

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def _prepare(self) -> None:
        if not self._prepared:  # wait for reductions, sums -> means (once per step)
            self._owner.engine.prepare_step()
            self._prepared = True

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ZeroOptimizer.step does not take a closure; "
                             "compute the loss and call backward() before step()")
        self._prepare()
        self.inner.step()
        self._owner.engine.after_step()
        self._prepared = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._owner.engine.zero_grad()
        self._prepared = False

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so their global L2 norm is at most `max_norm`; returns the norm
        before clipping. Call after backward, before step(); blocks (one tiny all-reduce
        at stages 1-3, where each rank holds only its shard of the gradient)."""
        self._prepare()
        grads = [p.grad for p in self._owner.engine.shard_parameters() if p.grad is not None]
        sq = torch.stack([g.float().square().sum() for g in grads]).sum() if grads \
            else torch.zeros(())
        if self._owner.stage > 0:
            comm.all_reduce(sq, self._owner.group, self._owner.comm_stats)
        norm = sq.sqrt()
        scale = max_norm / (norm + 1e-6)
        if scale < 1:
            for g in grads:
                g.mul_(scale)
        return norm

    def _layout(self) -> dict[str, Any]:
        o = self._owner
        shards = [int(p.numel()) for p in o.engine.shard_parameters()]
        return {"stage": o.stage, "world_size": o.world, "rank": o.rank, "shard_numels": shards}

    def state_dict(self) -> dict[str, Any]:
        return {"zero": self._layout(), "inner": self.inner.state_dict()}

    def sharded_state_dict(self) -> dict[str, Any]:
        """Optimizer state as per-parameter `ShardedTensor` pieces, for
        `disttrain.Checkpointer` (loads at any world size or stage; see checkpoint.py)."""
        o = self._owner
        return ckpt.sharded_state(self.inner, o.engine.shard_parameters(), o.engine.segments(),
                                  o.param_names)

    def load_sharded_state_dict(self, tree: dict[str, Any]) -> None:
        o = self._owner
        ckpt.load_sharded_state(self.inner, o.engine.shard_parameters(), o.engine.segments(),
                                o.param_names, tree)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "zero" not in state_dict or "inner" not in state_dict:
            raise ValueError("not a ZeroOptimizer state dict (keys 'zero' and 'inner' expected); "
                             "load a plain optimizer's state into .inner only if unsharded")
        saved, here = state_dict["zero"], self._layout()
        if saved != here:
            diff = {k: (saved.get(k), v) for k, v in here.items() if saved.get(k) != v}
            raise ValueError(f"optimizer state was saved with a different ZeRO layout "
                             f"(saved, here): {diff}; load it with the same stage, world size "
                             "and model on the same rank")
        self.inner.load_state_dict(state_dict["inner"])


def _unique(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    seen: set[int] = set()
    return [p for p in params if not (id(p) in seen or seen.add(id(p)))]


def _state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


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
