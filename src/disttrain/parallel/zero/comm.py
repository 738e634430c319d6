"""The three collectives ZeRO needs, each counting the bytes this rank sends.

ZeRO (Rajbhandari et al. 2019, arXiv 1910.02054, sec. 7) prices communication in bytes
each rank sends under ring algorithms on a group of N: all-reduce 2 (N-1)/N B,
reduce-scatter and all-gather (N-1)/N B, broadcast (N-1)/N B (setup). `CommStats` adds
those up from the calls actually issued, so tests check the paper's claim (stages 1-2
move what data parallelism moves, stage 3 1.5x). Algorithmic bytes, not socket bytes.
On gloo an all-gather is issued as one broadcast per owner; a torch without flat
reduce-scatter falls back to all-reduce + slice (docs/design/zero.md, "Gloo").

Who talks to whom: flat.py and stage3.py call these; these call disttrain.comm.ops
(recorded in the flight recorder, so a hang names the op, group, shapes and call site),
which calls torch.distributed.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from disttrain.comm import ops
from disttrain.comm.reducer import all_reduce_async, ring_reduce_scatter_async
from disttrain.trace import events as trace_events

__all__ = ["CommStats", "all_gather", "all_reduce", "broadcast", "reduce_scatter"]

_FLAT = hasattr(dist, "reduce_scatter_tensor") and hasattr(dist, "all_gather_into_tensor")


@dataclass
class CommStats:
    """Bytes this rank sent, per operation name (bookkeeping only; never blocks)."""

    sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, op: str, nbytes: float) -> None:
        self.sent[op] += int(round(nbytes))
        self.calls[op] += 1

    def total(self, exclude: tuple[str, ...] = ("broadcast",)) -> int:
        """Bytes sent by all ops except `exclude` (setup broadcasts by default)."""
        return sum(v for k, v in self.sent.items() if k not in exclude)

    def reset(self) -> None:
        self.sent.clear()
        self.calls.clear()


class _Done:
    """Stand-in handle for a collective that already completed (fallback path)."""

    def wait(self) -> bool:
        return True


class _All:
    """One handle over several: `wait()` blocks until each is done."""

    def __init__(self, works):
        self.works = works

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True


def _ring(n: int) -> float:
    return (n - 1) / n


def all_reduce(t: torch.Tensor, group, stats: CommStats, async_op: bool = False,
               algorithm: str = "native"):
    """Sum `t` in place over `group`; returns a handle when `async_op` (else blocks).
    `algorithm`: an allreduce algorithm of comm/algorithms.py (async: on its thread)."""
    n = dist.get_world_size(group)
    stats.add("all_reduce", 2 * _ring(n) * t.numel() * t.element_size())
    if async_op:
        return all_reduce_async(t, algorithm, group)
    if algorithm != "native":
        all_reduce_async(t, algorithm, group).wait()
        return None
    return ops.all_reduce(t, group=group)


@trace_events.traced("zero.reduce_scatter", "zero")
def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group, stats: CommStats,
                   async_op: bool = False, algorithm: str = "native"):
    """out (numel/N,) <- this rank's chunk of sum over ranks of inp (numel,).

    `out` may alias this rank's chunk of `inp` (in place). Handle when `async_op`.
    algorithm="ring" (async, in place only): comm.reducer's ring reduce-scatter.
    """
    n = dist.get_world_size(group)
    if algorithm == "ring":
        r = dist.get_rank(group)
        if not async_op or out.data_ptr() != inp[r * out.numel():].data_ptr():
            raise ValueError("the ring reduce-scatter runs async and in place "
                             "(out = this rank's chunk of inp)")
        stats.add("reduce_scatter", _ring(n) * inp.numel() * inp.element_size())
        return ring_reduce_scatter_async(inp, group)
    if not _FLAT:  # old torch: all_reduce a copy, keep our chunk
        tmp = inp.clone()
        all_reduce(tmp, group, stats)
        r = dist.get_rank(group)
        out.copy_(tmp[r * out.numel():(r + 1) * out.numel()])
        return _Done() if async_op else None
    stats.add("reduce_scatter", _ring(n) * inp.numel() * inp.element_size())
    return ops.reduce_scatter_tensor(out, inp, group=group, async_op=async_op)


@trace_events.traced("zero.all_gather", "zero")
def all_gather(out: torch.Tensor, inp: torch.Tensor, group, stats: CommStats,
               async_op: bool = False):
    """out (N*numel,) <- every rank's inp (numel,) in rank order; `inp` may alias out."""
    n = dist.get_world_size(group)
    stats.add("all_gather", _ring(n) * out.numel() * out.element_size())
    if dist.get_backend(group) == "gloo":
        return _gather_by_broadcast(out, inp, group, n, async_op)
    if not _FLAT:
        return ops.all_gather(list(out.chunk(n)), inp.clone(), group=group, async_op=async_op)
    return ops.all_gather_into_tensor(out, inp, group=group, async_op=async_op)


def _gather_by_broadcast(out, inp, group, n, async_op):
    """gloo: each rank broadcasts its chunk in place (N broadcasts, same bytes per rank).

    NOTE: measured at world 4 on 4 MiB, gloo's all_gather_into_tensor takes ~6.4 ms and
    four 1 MiB broadcasts ~2.1 ms; torch's ZeroRedundancyOptimizer gathers the same way.
    """
    r, size = dist.get_rank(group), inp.numel()
    chunks = out.view(-1).split(size)  # (N,) views of (numel,)
    if chunks[r].data_ptr() != inp.data_ptr():
        chunks[r].copy_(inp.reshape(-1))
    works = []
    for i, chunk in enumerate(chunks):
        src = i if group is None else dist.get_global_rank(group, i)
        works.append(ops.broadcast(chunk, src=src, group=group, async_op=True))
    handle = _All(works)
    if not async_op:
        handle.wait()
        return None
    return handle


def broadcast(t: torch.Tensor, group, stats: CommStats, src_in_group: int = 0) -> None:
    """Overwrite `t` with group rank `src_in_group`'s copy (blocks)."""
    n = dist.get_world_size(group)
    src = src_in_group if group is None else dist.get_global_rank(group, src_in_group)
    stats.add("broadcast", _ring(n) * t.numel() * t.element_size())
    ops.broadcast(t, src=src, group=group)
