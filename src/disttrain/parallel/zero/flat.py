"""ZeRO stages 0-2: full parameters in flat buckets, optimizer over this rank's shard.
Follows ZeRO (Rajbhandari et al. 2019, arXiv 1910.02054), stages 1-2.

Who talks to whom: api.Zero drives this; the shared `comm.reducer.BucketReducer` owns the
post-accumulate-grad hooks, the launch order and the end-of-backward wait, and calls this
module's `_stage`/`_prepare`/`_reduce`/`_complete`; those call comm.py.

More (the design and its reasons): docs/design/zero.md, "Notes from parallel/zero/flat.py".
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from disttrain.comm.buckets import assign_buckets
from disttrain.comm.reducer import BucketReducer
from disttrain.parallel.zero import comm
from disttrain.parallel.zero.mixed import accumulate_shard_grad

__all__ = ["FlatShards", "Piece", "Segment"]


class Piece(NamedTuple):
    """One parameter inside a flat buffer (bucket or stage-3 unit)."""

    param_id: int
    """id() of the parameter."""
    offset: int
    """Its first element in the flat buffer."""
    numel: int


class Segment(NamedTuple):
    """This rank's shard of one flat buffer: elements [lo, hi), and what the buffer holds."""

    lo: int
    hi: int
    pieces: list[Piece]

_MAX_INFLIGHT = 2  # stage 2: bucket reduce-scatters in flight (each holds a full bucket)


class _Bucket:
    """One flat buffer of parameters and its gradient state (bookkeeping, no comm)."""

    def __init__(self, params, offsets, numel, lo, hi, stage):
        self.params, self.offsets = params, offsets
        self.offset_of = {id(p): off for p, off in zip(params, offsets)}
        p0 = params[0]
        self.data = torch.zeros(numel, dtype=p0.dtype, device=p0.device)  # (numel,)
        with torch.no_grad():
            for p, off in zip(params, offsets):
                self.data[off:off + p.numel()].copy_(p.detach().reshape(-1))
                p.data = self.data[off:off + p.numel()].view_as(p)
        self.lo, self.hi = lo, hi  # owned chunk [lo, hi) of the flat buffer
        self.shard = nn.Parameter(self.data[lo:hi])  # a view: no extra memory
        self.grad = None  # stages 0-1: (numel,) buffer the .grad views live in
        if stage < 2:
            self.grad = torch.zeros_like(self.data)
            for p, off in zip(params, offsets):
                p.grad = self.grad[off:off + p.numel()].view_as(p)
            self.shard.grad = self.grad[lo:hi]
        self.rgrad = None  # with reduce_dtype: (hi - lo,) reduced shard gradient in it

    def _view(self, p: torch.Tensor) -> torch.Tensor:
        off = self.offset_of[id(p)]
        return self.grad[off:off + p.numel()].view_as(p)

    def grad_view_ptr(self, p: torch.Tensor) -> int:
        return self._view(p).data_ptr()

    @torch.no_grad()
    def rebind_grad(self, p: torch.Tensor) -> None:
        view = self._view(p)
        view.copy_(p.grad)
        p.grad = view


class FlatShards:
    """Stages 0-2 over `params` (a deduplicated list); see the module docstring."""

    def __init__(self, params: list[nn.Parameter], stage: int, group, bucket_bytes: int,
                 stats: comm.CommStats, group_of: dict[int, int] | None = None,
                 reduce_dtype: torch.dtype | None = None, separate: set[int] = frozenset(),
                 algorithm: str = "native"):
        import torch.distributed as dist

        if stage not in (0, 1, 2):
            raise ValueError(f"FlatShards handles stages 0-2, got {stage}")
        self.stage, self.group, self.stats, self.algorithm = stage, group, stats, algorithm
        self.reduce_dtype = reduce_dtype if reduce_dtype != params[0].dtype else None
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        pad = 1 if stage == 0 else self.world
        group_of = group_of or {}
        # NOTE: the optimizer group is part of the key: groups never share a flat shard
        specs = assign_buckets(
            [p.numel() for p in params], [p.element_size() for p in params], bucket_bytes,
            keys=[(p.dtype, p.device, group_of.get(id(p), 0), id(p) if id(p) in separate else 0)
                  for p in params], pad_to=pad)
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        for spec in specs:
            if stage == 0:
                lo, hi = 0, spec.numel
            else:
                size = spec.numel // self.world
                lo, hi = self.rank * size, (self.rank + 1) * size
            members = [params[i] for i in spec.indices]
            b = _Bucket(members, list(spec.offsets), spec.numel, lo, hi, stage)
            b.group = group_of.get(id(members[0]), 0)
            self.buckets.append(b)
            for p in members:
                self._bucket_of[id(p)] = b
        # NOTE: at most 2 transient full-size gradients in flight (stage 2, reduce_dtype)
        inflight = _MAX_INFLIGHT if stage == 2 or self.reduce_dtype is not None else None
        self._reducer = BucketReducer(
            params, [spec.indices for spec in specs], reduce=self._reduce,
            prepare=self._prepare, complete=self._complete, stage=self._stage,
            missing=self._partial, max_inflight=inflight, owner="Zero")

    def shard_parameters(self) -> list[nn.Parameter]:
        """One flat parameter per bucket: what this rank's optimizer updates."""
        return [b.shard for b in self.buckets]

    def shard_groups(self) -> list[int]:
        """The optimizer group index of each shard parameter (same order)."""
        return [b.group for b in self.buckets]

    def shard_grads(self) -> list[torch.Tensor | None]:
        """The reduced gradient of each shard parameter (same order): `shard.grad`, or
        in `reduce_dtype` when one is set. Sums until prepare_step() averages them."""
        if self.reduce_dtype is None:
            return [b.shard.grad for b in self.buckets]
        return [b.rgrad for b in self.buckets]

    def separate_grad(self, p: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the gradient sum of `p`, which has a bucket of its own
        (`separate`); zeros if it got none. Waits for reductions (blocks)."""
        self.finish()
        b = self._bucket_of[id(p)]
        if len(b.params) != 1:
            raise ValueError("separate_grad needs a parameter given in `separate`")
        i = self.buckets.index(b)
        if self.shard_grads()[i] is None:
            self._add_shard_grad(b, torch.zeros(b.hi - b.lo, dtype=self.reduce_dtype or
                                                b.data.dtype, device=b.data.device))
        return self.shard_grads()[i]

    def _add_shard_grad(self, b: _Bucket, out: torch.Tensor) -> None:
        accumulate_shard_grad(b, out, self.reduce_dtype)

    def segments(self) -> list[Segment]:
        """Per shard parameter: its slice of its bucket and the parameters in the bucket."""
        return [Segment(b.lo, b.hi, [Piece(id(p), off, p.numel())
                                     for p, off in zip(b.params, b.offsets)])
                for b in self.buckets]

    # ---- backward: the shared reducer calls these (comm/reducer.py) ----------------

    def _stage(self, i: int, p: torch.Tensor) -> None:
        b = self.buckets[self._reducer.bucket_of[i]]
        if b.grad is not None and p.grad.data_ptr() != b.grad_view_ptr(p):
            # the user set .grad to None (e.g. module.zero_grad()): move it back in place
            b.rebind_grad(p)

    def _partial(self, missing: list[int]) -> list[int]:
        """End of backward: parameters without a gradient count as 0 in buckets that got
        some gradients; a bucket that got none is not reduced in this backward."""
        r = self._reducer
        return [i for i in missing if r.pending[r.bucket_of[i]] < len(r.members[r.bucket_of[i]])]

    def _reduce(self, t: torch.Tensor):
        """Start bucket tensor `t`'s collective: all-reduce (stage 0, with `algorithm`) or
        reduce-scatter into this rank's own chunk of `t`, in place (stages 1-2; the
        backend's, or with algorithm="ring" the ring's)."""
        if self.stage == 0:
            return comm.all_reduce(t, self.group, self.stats, async_op=True,
                                   algorithm=self.algorithm)
        size = t.numel() // self.world
        return comm.reduce_scatter(t[self.rank * size:(self.rank + 1) * size], t, self.group,
                                   self.stats, async_op=True, algorithm=self.algorithm)

    @torch.no_grad()
    def _prepare(self, k: int):
        """What bucket k sends: its gradient buffer in place (stages 0-1), or a transient
        flat copy of its gradients (stage 2; any stage with `reduce_dtype`: cast up)."""
        b = self.buckets[k]
        if self.reduce_dtype is None and self.stage < 2:
            return b.grad, None
        flat = torch.zeros(b.data.numel(), dtype=self.reduce_dtype or b.data.dtype,
                           device=b.data.device)  # (numel,)
        for p, off in zip(b.params, b.offsets):
            if p.grad is not None:
                flat[off:off + p.numel()].copy_(p.grad.reshape(-1))
        if self.stage < 2:
            b.grad.zero_()  # NOTE: the sum now lives in b.rgrad; the next backward adds anew
        else:
            for p in b.params:
                p.grad = None
        return flat, None

    @torch.no_grad()
    def _complete(self, k: int, t: torch.Tensor, _ctx) -> None:
        b = self.buckets[k]
        if self.stage == 0 and self.reduce_dtype is None:
            b.grad.div_(self.world)  # NOTE: average now (DDP semantics) so re-reduce is right
        elif self.stage == 0:
            self._add_shard_grad(b, t)  # the sum, averaged in prepare_step
        elif self.stage == 1 and self.reduce_dtype is None:
            b.grad[:b.lo].zero_()  # chunks we do not own are never read again
            b.grad[b.hi:].zero_()
        else:
            self._add_shard_grad(b, t[b.lo:b.hi].clone())  # NOTE: frees the transient flat

    def finish(self) -> None:
        """Reduce buckets whose hooks did not all fire, then wait for all (blocks)."""
        self._reducer.finish()

    # ---- step --------------------------------------------------------------------

    @torch.no_grad()
    def prepare_step(self, average: bool = True) -> None:
        """Wait for reductions and (`average`) turn gradient sums into means (blocks)."""
        self.finish()
        if (self.stage == 0 and self.reduce_dtype is None) or not average:
            return
        for g in self.shard_grads():
            if g is not None:
                g.div_(self.world)

    @torch.no_grad()
    def after_step(self) -> None:
        """All-gather every rank's updated chunk into the full buffers (blocks)."""
        if self.stage == 0:
            return
        works = [comm.all_gather(b.data, b.data[b.lo:b.hi], self.group, self.stats,
                                 async_op=True) for b in self.buckets]
        for w in works:
            w.wait()

    def zero_grad(self) -> None:
        """Forget gradients: zero the flat buffers (stages 0-1) or drop shards (stage 2)."""
        self.finish()
        for b in self.buckets:
            b.rgrad = None
            if self.stage < 2:
                b.grad.zero_()
            else:
                b.shard.grad = None
                for p in b.params:
                    p.grad = None

    # ---- what this rank holds (for disttrain.memory) ------------------------------

    def held(self) -> dict[str, list[torch.Tensor]]:
        """Tensors this rank keeps between steps: parameters and gradients."""
        grads = [b.grad for b in self.buckets if b.grad is not None]
        grads += [b.shard.grad for b in self.buckets if self.stage == 2 and b.shard.grad is not None]
        grads += [p.grad for b in self.buckets for p in b.params
                  if self.stage == 2 and p.grad is not None]
        grads += [b.rgrad for b in self.buckets if b.rgrad is not None]
        return {"params": [b.data for b in self.buckets], "grads": grads}
