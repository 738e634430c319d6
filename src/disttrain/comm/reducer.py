"""The bucketed gradient reducer DataParallel and ZeRO stages 0-2 share.

Li et al., "PyTorch Distributed" (VLDB 2020), sec. 3.2: a post-accumulate-grad hook
per parameter counts down its bucket; a full bucket's reduction is launched
asynchronously while autograd goes on with earlier layers (buckets launch strictly in
index order on every rank, so collectives match across ranks); the first hook of a
backward queues an autograd engine callback that, when backward is done, deals with
parameters that got no gradient, launches the rest and waits for everything.

`BucketReducer` owns exactly that and nothing else. What a bucket holds and sends, and
what happens after its reduction, are the strategy's, passed in as callbacks: DataParallel
stages `grad / world` into bucket views and compresses on the wire (data_parallel.py);
ZeRO keeps `.grad` views of flat buffers and feeds its shard gradients (zero/flat.py).
The collective itself is a callback too: `all_reduce_async(t, algorithm, group)` (the
allreduce algorithms of comm/algorithms.py, overlapping backward on the group's one
thread, comm/threads.py), or ZeRO's reduce-scatter (the backend's, or `ring_reduce_scatter_async`).
Nothing here knows a strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from disttrain.comm.algorithms import ALGORITHMS, all_reduce, ring_reduce_scatter, run_recorded
from disttrain.comm.threads import submit_on_group_thread
from disttrain.trace import events as trace_events

__all__ = ["BucketReducer", "all_reduce_async", "check_algorithm", "ring_reduce_scatter_async"]

_engine = torch.autograd.Variable._execution_engine


def check_algorithm(algorithm: str, owner: str) -> str:
    """`algorithm` if it names an allreduce algorithm, else a ValueError saying which do."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{owner}: unknown allreduce algorithm {algorithm!r}; pick one of "
                         f"{', '.join(ALGORITHMS)} (native: the backend's own, the default)")
    return algorithm


def all_reduce_async(tensor: torch.Tensor, algorithm: str = "native", group=None):
    """Start summing `tensor` in place over `group`; returns a handle whose `wait()` blocks.

    "native" is the backend's own asynchronous all_reduce (gloo's ring, NCCL). Any other
    algorithm (comm/algorithms.py) runs on the group's algorithm thread (comm/threads.py).
    """
    return all_reduce(tensor, group=group, async_op=True, algorithm=algorithm)


def ring_reduce_scatter_async(tensor: torch.Tensor, group=None):
    """Start a ring reduce-scatter of `tensor` (1-D, numel a multiple of N) in place:
    chunk r of N equal chunks ends holding the sum on group rank r (the other chunks hold
    partial sums). Runs on the group's algorithm thread; returns a Future (`wait()`)."""
    return submit_on_group_thread(group, "reduce_scatter[ring]", _ring_reduce_scatter, tensor, group)


def _ring_reduce_scatter(tensor: torch.Tensor, group) -> None:
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    n, me = len(ranks), ranks.index(dist.get_rank())
    if tensor.dim() != 1 or tensor.numel() % n or not tensor.is_contiguous():
        raise ValueError(f"ring reduce-scatter needs a contiguous 1-D tensor whose length is a "
                         f"multiple of the group size {n}; got shape {tuple(tensor.shape)}")
    if n == 1:
        return
    # NOTE: ring_reduce_scatter leaves index i holding chunk i+1; renumbering the same
    # ring one place back makes rank r hold chunk r, as ZeRO's shards are laid out.
    run_recorded("reduce_scatter[ring]", tensor, group, ranks,
                 lambda: ring_reduce_scatter(tensor, ranks[1:] + ranks[:1], (me - 1) % n))


class BucketReducer:
    """Hook-driven bucket state machine over `params`; see the module docstring.

    buckets: member parameter indices of each bucket (launch order = list order).
    reduce(tensor) -> handle: start the collective (handle.wait() blocks until done).
    prepare(b) -> (tensor, ctx): what bucket b sends, once all its members are ready.
    complete(b, tensor, ctx): after bucket b's collective finished.
    stage(i, param): parameter i's gradient exists (put it where its bucket sees it).
    missing(indices) -> indices: at the end of backward, the parameters that got no
        gradient; return those that count as zero contributions (or raise). Buckets left
        incomplete after that are not reduced in this backward.
    launched(): after the last launch of a backward, before waiting (e.g. more collectives).
    done(): after every bucket of a backward completed.
    max_inflight: at most this many launched, uncompleted buckets (None: no bound).
    owner, names: for error messages ("DataParallel: parameter 'fc.weight' ...").
    Blocks only at the end of backward (and in `finish`, `abandon`, and when max_inflight
    is reached).
    """

    def __init__(self, params: Sequence[torch.Tensor], buckets: Sequence[Sequence[int]], *,
                 reduce: Callable, prepare: Callable, complete: Callable,
                 stage: Callable | None = None, missing: Callable | None = None,
                 launched: Callable | None = None, done: Callable | None = None,
                 max_inflight: int | None = None, owner: str = "reducer",
                 names: Sequence[str] | None = None):
        self.params = list(params)
        self.reduce, self.prepare, self.complete = reduce, prepare, complete
        self.stage, self.missing, self.launched, self.done = stage, missing, launched, done
        self.max_inflight, self.owner = max_inflight, owner
        self.names = list(names) if names is not None else [str(i) for i in range(len(params))]
        self.enabled = True
        self.events: list[tuple[str, int]] = []
        self.set_buckets(buckets)
        self.handles = [p.register_post_accumulate_grad_hook(self._hook(i))
                        for i, p in enumerate(self.params)]

    def set_buckets(self, buckets: Sequence[Sequence[int]]) -> None:
        """(Re)cut: bucket b holds parameters buckets[b]. Only between backward passes."""
        self.members = [tuple(m) for m in buckets]
        self.bucket_of = [0] * len(self.params)
        for b, members in enumerate(self.members):
            for i in members:
                self.bucket_of[i] = b
        self._reset()

    def _reset(self) -> None:
        self.active = False
        self.ready = [False] * len(self.params)
        self.pending = [len(m) for m in self.members]
        self.works: list[tuple | None] = [None] * len(self.members)
        self.next_launch = 0
        self.t_ready: list = [None] * len(self.members)  # trace stamps (None: tracing off)
        self.t_launch: list = [None] * len(self.members)

    def remove(self) -> None:
        """Remove the hooks (the reducer is no longer used)."""
        for h in self.handles:
            h.remove()
        self.handles = []

    def _hook(self, i: int):
        def hook(param: torch.Tensor) -> None:
            if self.enabled:
                self._mark_ready(i, param)
        return hook

    def _mark_ready(self, i: int, param: torch.Tensor) -> None:
        if not self.active:
            self.active, self.events = True, []
            # NOTE: queued from inside backward, so it runs once this backward is done.
            _engine.queue_callback(self._end_of_backward)
        if self.ready[i]:
            self.abandon()
            raise RuntimeError(
                f"{self.owner}: parameter '{self.names[i]}' received its gradient twice in "
                "one backward; reentrant backward or a second backward of the same graph "
                "inside one step is not supported")
        self.events.append(("grad", i))
        if self.stage is not None:
            self.stage(i, param)
        self.ready[i] = True
        b = self.bucket_of[i]
        self.pending[b] -= 1
        if self.pending[b] == 0:
            self.t_ready[b] = trace_events.stamp()
            self._launch_ready()

    def _launch_ready(self, final: bool = False) -> None:
        """Launch full buckets in index order (`final`: every full one, skipping the rest)."""
        # NOTE: in index order on every rank, even if buckets fill out of order, so
        # collectives match across ranks.
        while self.next_launch < len(self.members):
            b = self.next_launch
            if self.pending[b] == 0:
                if self.works[b] is not None:  # NOTE: never twice in flight: finish the first
                    self._wait(b)
                tensor, ctx = self.prepare(b)
                self.t_launch[b] = trace_events.stamp()
                if self.t_ready[b] is None:  # NOTE: completed in finish() (missing params)
                    self.t_ready[b] = self.t_launch[b]
                self.works[b] = (self.reduce(tensor), tensor, ctx)
                self.events.append(("launch", b))
                self._bound_inflight(b)
            elif not final:
                return
            self.next_launch += 1

    def _bound_inflight(self, newest: int) -> None:
        if self.max_inflight is None:
            return
        inflight = [b for b, w in enumerate(self.works) if w is not None and b != newest]
        while len(inflight) >= self.max_inflight:  # NOTE: bounds transient buffers
            self._wait(inflight.pop(0))

    def _wait(self, b: int) -> None:
        work, tensor, ctx = self.works[b]
        self.works[b] = None
        work.wait()
        self.complete(b, tensor, ctx)
        self.events.append(("wait", b))
        trace_events.bucket(b, self.t_ready[b], self.t_launch[b],
                            tensor.numel() * tensor.element_size())

    def wait_launched(self) -> None:
        """Wait for (and complete) every launched bucket. Blocks."""
        for b, entry in enumerate(self.works):
            if entry is not None:
                self._wait(b)

    def abandon(self) -> None:
        """Drop a backward that cannot finish: wait for what was launched, forget the rest."""
        self.wait_launched()
        self._reset()

    def _end_of_backward(self) -> None:
        self.events.append(("backward_end", -1))
        self.finish()

    def finish(self) -> None:
        """Launch what is left, wait for everything, call `done`. Blocks; a no-op when
        no gradient arrived since the last finish."""
        if not self.active:
            self.wait_launched()
            return
        try:
            missing = [i for i, r in enumerate(self.ready) if not r]
            if missing and self.missing is not None:
                try:
                    counted = self.missing(missing)
                except BaseException:
                    self.wait_launched()  # NOTE: keeps the group usable after the error
                    raise
                for i in counted:
                    self.ready[i] = True
                    self.pending[self.bucket_of[i]] -= 1
            self._launch_ready(final=True)
            if self.launched is not None:
                self.launched()
            self.wait_launched()
        finally:
            self._reset()
        if self.done is not None:
            self.done()

