"""Synchronous data parallelism: bucketed gradient all-reduce overlapped with backward.

Follows Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training" (VLDB 2020), i.e. what torch DDP does, written out in Python: broadcast from
rank 0 on wrap; in backward, per-parameter hooks put `grad / world` into flat buckets
(gradients are views of them) and launch each full bucket's all-reduce while autograd
goes on; at the end of backward, wait and leave the average in `param.grad`.
Step by step, zero copy, unused parameters, auto-tuning: docs/design/data-parallel.md.

Who talks to whom: the user's autograd backward -> the shared `comm.reducer.BucketReducer`
(hooks, launch order, end-of-backward wait; ZeRO stages 0-2 use it too) -> `_GradSync`
here (bucket views, grad / world, compression, unused parameters) -> recorded
collectives (comm/ops.py; `algorithm=` other than native: comm/algorithms.py) ->
torch.distributed on `group` (gloo or NCCL; tensors stay on their own device).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from disttrain import preempt
from disttrain.comm import ops
from disttrain.comm.buckets import BucketSizeTuner, FlatBucket, assign_buckets
from disttrain.comm.collectives import broadcast_tensors, global_rank
from disttrain.comm.compression import (
    BF16Compression,
    Compression,
    FP16Compression,
    NoCompression,
    resolve_compression,
)
from disttrain.comm.reducer import BucketReducer, all_reduce_async, check_algorithm
from disttrain.finite import FiniteGradCheck

__all__ = ["DataParallel"]

_FIRST_BUCKET_BYTES = 2**20  # DDP's first bucket: 1 MiB, so communication starts early
_AT_FIRST_GRAD = -1.0  # a compiled forward's step start: take it at the first gradient


class DataParallel(nn.Module):
    """Replicate `module` over `group`; average gradients by bucketed all-reduce.

    bucket_mb: bucket capacity in MiB (25 as torch DDP), or "auto" to time a few sizes
        on the first steps and keep the fastest (agreed on by all ranks).
    compression: None/"fp16"/"bf16" or a `Compression` object, applied on the wire.
    find_unused: treat a parameter that got no gradient in a step as a zero
        contribution instead of raising (costs one small extra all-reduce per step).
    group: the process group to replicate over (None = all ranks); broadcasts come
        from its rank 0.
    broadcast_buffers: re-broadcast buffers (e.g. BatchNorm statistics) from group
        rank 0 before each training forward, as DDP does.
    gradient_as_bucket_view: leave `param.grad` as a view into the bucket buffer.
    check_finite: check every rank's own gradients for NaN/inf before they are
        averaged; a bad step raises `NonFiniteGradError` from backward() on every rank,
        naming the parameters and ranks (disttrain.finite; one tiny all-reduce per step).
    algorithm: how buckets are all-reduced: "native" (the backend's own, default),
        "ring", "halving-doubling", "tree", "hierarchical" or "auto"
        (disttrain.comm.algorithms; they run on a thread, so buckets still overlap
        backward). Works with compression (the compressed wire tensor is reduced).

    Construction blocks (a broadcast); forward/backward block only where DDP's do.
    NOTE: as with DDP, every rank must run the same backward: reentrant activation
    checkpointing (use_reentrant=True) runs nested backwards and is not supported; use
    torch.utils.checkpoint(..., use_reentrant=False).
    """

    def __init__(self, module: nn.Module, bucket_mb: float | str = 25,
                 compression: Compression | str | None = None, find_unused: bool = False,
                 group: dist.ProcessGroup | None = None, broadcast_buffers: bool = True,
                 gradient_as_bucket_view: bool = True, check_finite: bool = False,
                 algorithm: str = "native"):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"DataParallel wraps an nn.Module, got {type(module).__name__}")
        self.algorithm = check_algorithm(algorithm, "DataParallel")
        if not dist.is_initialized():
            raise RuntimeError("DataParallel needs a process group: call disttrain.init() first")
        if dist.get_rank(group) < 0:
            raise ValueError(f"rank {dist.get_rank()} is not a member of the group it was given")
        self.module = module
        self.group = group
        self.find_unused = find_unused
        self.broadcast_buffers = broadcast_buffers
        self.compression = resolve_compression(compression)
        self.world = dist.get_world_size(group)
        self.src = global_rank(group, 0)
        seen: set[int] = set()
        self._named = [(n, p) for n, p in module.named_parameters()
                       if p.requires_grad and not (id(p) in seen or seen.add(id(p)))]
        if not self._named:
            raise ValueError("DataParallel: the module has no parameter that requires grad; wrap "
                             "the model being trained (a frozen model needs no DataParallel)")
        total = sum(p.numel() * p.element_size() for _, p in self._named)
        self.tuner = BucketSizeTuner.parse(bucket_mb, total)  # NOTE: validate, then talk
        self._buffers_list = [b for b in module.buffers()]
        broadcast_tensors([p for _, p in self._named] + self._buffers_list, 0, group)
        self._sync = _GradSync(self._named, self.tuner.current_bytes(), self.compression,
                               find_unused, group, self.world, gradient_as_bucket_view,
                               self.algorithm)
        self._sync.on_step_end = self._on_step_end
        self._step_start: float | None = None
        self._finite = FiniteGradCheck(module, group) if check_finite else None

    @property
    def bucket_mb(self) -> float:
        """Bucket capacity in use now, in MiB."""
        return self._sync.cap_bytes / 2**20

    @property
    def num_buckets(self) -> int:
        return len(self._sync.buckets)

    @property
    def last_step_events(self) -> list[tuple[str, int]]:
        """What the last synced backward did, in order: ("grad", param index),
        ("launch", bucket), ("backward_end", -1), ("wait", bucket)."""
        return list(self._sync.events)

    def forward(self, *args, **kwargs):
        # NOTE: under torch.compile this body is traced: host-side work is either plain
        # attribute reads Dynamo can guard on, or runs outside the graph (broadcast_tensors,
        # the step clock taken in backward), so the wrapped module compiles as one graph.
        if self.broadcast_buffers and self._buffers_list and self.training \
                and torch.is_grad_enabled():
            broadcast_tensors(self._buffers_list, 0, self.group)
        if self._sync.active:
            warnings.warn("DataParallel: the previous backward did not finish (an exception "
                          "inside backward?); its gradients were not synchronized",
                          RuntimeWarning, stacklevel=2)
            self._sync.abandon()
        if self._sync.enabled and self._step_start is None and torch.is_grad_enabled():
            # NOTE: a compiled forward cannot read the clock; the tuner's step then starts
            # at this backward's first gradient (_GradSync.first_grad_at) instead.
            self._step_start = _AT_FIRST_GRAD if torch.compiler.is_compiling() \
                else time.perf_counter()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; no communication.

        The first synced backward after it averages the accumulated sums.
        """
        before = self._sync.enabled
        self._sync.enabled = False
        try:
            yield
        finally:
            self._sync.enabled = before

    def _on_step_end(self) -> None:
        if self._finite is not None:
            self._finite.check()  # NOTE: all ranks raise together, before the optimizer step
        # Bucket-size auto-tuning: every rank times its steps; the choice is made on
        # the max over ranks (one tiny all-reduce), so all ranks rebucket identically.
        start, self._step_start = self._step_start, None
        if start == _AT_FIRST_GRAD:
            start = self._sync.first_grad_at
        if self.tuner.done or start is None:
            return
        self.tuner.record(time.perf_counter() - start)
        if self.tuner.wants_agreement():
            device = self._named[0][1].device  # NOTE: NCCL reduces device tensors only
            times = torch.tensor(self.tuner.candidate_times(), dtype=torch.float64,
                                 device=device)
            ops.all_reduce(times, op=dist.ReduceOp.MAX, group=self.group)
            self.tuner.agree(times.tolist())
        if self.tuner.current_bytes() != self._sync.cap_bytes:
            self._sync.rebucket(self.tuner.current_bytes())


class _GradSync:
    """DataParallel's side of the shared `BucketReducer`: the bucket views, grad / world,
    compression, unused parameters, and the averaged gradients written back."""

    def __init__(self, named, cap_bytes, compression, find_unused, group, world, as_view,
                 algorithm="native"):
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.compression = compression or NoCompression()
        self.find_unused, self.group, self.world, self.as_view = find_unused, group, world, as_view
        self.algorithm = algorithm
        self.on_step_end = None
        self.first_grad_at: float | None = None  # perf_counter() at this backward's first grad
        self.keys = [(p.dtype, p.device) for p in self.params]
        self._no_grad: set[int] = set()
        self._missing: list[int] = []
        self._used: list[bool] | None = None
        self._layout()
        self.reducer = BucketReducer(
            self.params, [], reduce=self._reduce, prepare=self._prepare,
            complete=self._complete, stage=self._stage, missing=self._on_missing,
            launched=self._on_launched, done=self._done, owner="DataParallel", names=self.names)
        self.rebucket(cap_bytes)

    # NOTE: the reducer's state, read by DataParallel (no_sync, forward's check, events)
    enabled = property(lambda self: self.reducer.enabled,
                       lambda self, v: setattr(self.reducer, "enabled", v))
    active = property(lambda self: self.reducer.active)
    events = property(lambda self: self.reducer.events)

    def abandon(self) -> None:
        self.reducer.abandon()

    def _layout(self) -> None:
        """One flat gradient buffer per (dtype, device), params in reverse registration
        order; each parameter's slot (`view_of[i]`) never moves, buckets are slices."""
        self.flat: dict[tuple, torch.Tensor] = {}
        self.flat_offset = [0] * len(self.params)
        sizes: dict[tuple, int] = {}
        for i in reversed(range(len(self.params))):  # NOTE: same order as assign_buckets
            key = self.keys[i]
            self.flat_offset[i] = sizes.get(key, 0)
            sizes[key] = self.flat_offset[i] + self.params[i].numel()
        for key, numel in sizes.items():
            # NOTE: one spare element at the end: the preemption flag (see rebucket)
            self.flat[key] = torch.zeros(numel + 1, dtype=key[0], device=key[1])  # (numel + 1,)
        self.view_of = [self.flat[self.keys[i]].narrow(0, self.flat_offset[i], p.numel())
                        .view(p.shape) for i, p in enumerate(self.params)]

    def rebucket(self, cap_bytes: int) -> None:
        """(Re)cut the flat buffers into buckets of `cap_bytes`; moves no data."""
        self.cap_bytes = cap_bytes
        specs = assign_buckets([p.numel() for p in self.params],
                               [p.element_size() for p in self.params], cap_bytes,
                               keys=self.keys, first_cap_bytes=_FIRST_BUCKET_BYTES)
        self.buckets = []
        for spec in specs:
            start = self.flat_offset[spec.indices[0]]
            buffer = self.flat[spec.key].narrow(0, start, spec.numel)
            members = [self.params[i] for i in spec.indices]
            self.buckets.append(FlatBucket(spec, [p.shape for p in members], members[0].dtype,
                                           members[0].device, buffer=buffer))
        self.reducer.set_buckets([spec.indices for spec in specs])
        self._place_flag(specs[-1].key, self.flat_offset[specs[-1].indices[0]], specs[-1].numel)

    def _place_flag(self, key, start: int, numel: int) -> None:
        """Let the last bucket carry disttrain.preempted()'s flag in the spare element
        after it (disttrain/preempt.py): only over the whole world (every rank must get
        the same sum) and with a wire that keeps small integers exact."""
        flat = self.flat[key]
        exact = type(self.compression) in (NoCompression, FP16Compression, BF16Compression)
        if self.world == dist.get_world_size() and exact and start + numel == flat.numel() - 1:
            self._flag_bucket = len(self.buckets) - 1
            self._flag_wire = flat.narrow(0, start, numel + 1)  # (numel + 1,) the bucket + flag
            self._flag = flat.narrow(0, numel + start, 1)  # (1,)
        else:
            self._flag_bucket, self._flag_wire, self._flag = -1, None, None

    # ---- callbacks of the reducer ----------------------------------------------------

    def _reduce(self, wire: torch.Tensor):
        return all_reduce_async(wire, self.algorithm, self.group)

    def _prepare(self, b: int):
        if b == self._flag_bucket:
            self._flag.fill_(preempt.flag_value())
            return self.compression.compress(self._flag_wire)
        return self.compression.compress(self.buckets[b].buffer)

    def _complete(self, b: int, wire: torch.Tensor, ctx) -> None:
        out = self.compression.decompress(wire, ctx)
        target = self._flag_wire if b == self._flag_bucket else self.buckets[b].buffer
        if out.data_ptr() != target.data_ptr():
            target.copy_(out)
        if b == self._flag_bucket:
            preempt.deliver(self._flag)

    def _stage(self, i: int, param: torch.Tensor) -> None:
        if len(self.reducer.events) == 1:  # NOTE: the first gradient of this backward
            self.first_grad_at = time.perf_counter()
        self._put(i, param.grad)

    @torch.no_grad()
    def _put(self, i: int, grad: torch.Tensor | None) -> None:
        """Put grad / world into the bucket slot of parameter i (zeros when None)."""
        view = self.view_of[i]
        if grad is None:
            view.zero_()
        elif grad.is_sparse:
            raise RuntimeError(f"DataParallel: parameter '{self.names[i]}' has a sparse "
                               "gradient; use dense gradients (e.g. Embedding(sparse=False))")
        elif grad.data_ptr() == view.data_ptr():
            view.mul_(1.0 / self.world)  # already in the bucket: zero copy
        else:
            torch.mul(grad, 1.0 / self.world, out=view)
            if self.as_view:
                self.params[i].grad = view

    def _on_missing(self, missing: list[int]) -> list[int]:
        """End of backward: parameters without a gradient count as zeros (find_unused)."""
        if not self.find_unused:
            raise RuntimeError(self._unused_message(missing))
        self._missing = missing
        self._no_grad = {i for i in missing if self.params[i].grad is None}
        for i in missing:
            self._put(i, self.params[i].grad)
        return missing

    def _on_launched(self) -> None:
        if self.find_unused:  # NOTE: after every bucket's launch, so all ranks agree on order
            flags = torch.ones(len(self.params), dtype=torch.int32, device=self.params[0].device)
            flags[self._missing] = 0
            ops.all_reduce(flags, group=self.group)  # (P,) how many ranks used each param
            self._used = (flags > 0).tolist()

    def _done(self) -> None:
        try:
            self._write_back()
        finally:
            self._missing, self._no_grad, self._used = [], set(), None
        if self.on_step_end is not None:
            self.on_step_end()

    @torch.no_grad()
    def _write_back(self) -> None:
        for i, p in enumerate(self.params):
            view = self.view_of[i]
            if self._used is not None and not self._used[i] and i in self._no_grad:
                continue  # no rank had a gradient: leave None, as a single process would
            if p.grad is None:
                p.grad = view if self.as_view else view.clone()
            elif p.grad.data_ptr() != view.data_ptr():
                p.grad.copy_(view)

    def _unused_message(self, missing: list[int]) -> str:
        names = [self.names[i] for i in missing]
        more = f" (and {len(names) - 1} more: {', '.join(names[1:6])})" if len(names) > 1 else ""
        return (
            f"DataParallel: parameter '{names[0]}' received no gradient in this step on "
            f"rank {dist.get_rank()}{more}. Every parameter must take part in the loss on "
            "every rank; if some are legitimately unused (conditional branches, frozen "
            "heads), pass find_unused=True to DataParallel, or set requires_grad=False "
            "on them before wrapping."
        )
