"""Recorded collectives: torch.distributed's verbs, each numbered and watched.

`disttrain.comm.all_reduce(t)` does what `torch.distributed.all_reduce(t)` does, and
also records it in this process's flight recorder (comm/flight.py): sequence number in
its group, op, shapes, the user's call site; when it does not complete within the
timeout (DISTTRAIN_TIMEOUT, 60 s by default) the rank reports where it is and the
launcher prints one merged report. Arguments are checked first, so a wrong `src` or
a list of the wrong length says what to fix instead of failing deep inside torch.

Blocking: like torch, each call blocks until done unless `async_op=True`, which
returns a handle whose `wait()` blocks.

Who talks to whom: strategies and user code call these; these call torch.distributed
and comm/flight.py. `recorder()` owns the per-process FlightRecorder (see flight.py).
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref

import torch
import torch.distributed as dist

from disttrain import settings
from disttrain.comm.flight import EXIT_HANG, Entry, FlightRecorder, format_ranks
from disttrain.trace import hooks as trace_hooks

__all__ = [
    "CollectiveError", "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
    "reduce_scatter_tensor", "barrier", "send", "recv", "isend", "irecv", "recorder",
]

ReduceOp = dist.ReduceOp

_lock = threading.Lock()
_recorder: FlightRecorder | None = None  # NOTE: per process; see flight.py


class CollectiveError(RuntimeError):
    """A collective timed out or failed; the message names it, its call site and a fix.

    `disttrain_failure` tells disttrain's per-rank wrapper (launch/entry.py) and the launcher
    that this rank is not the cause: `timeout` (the others never joined) or `peer-lost`
    (the backend failed, usually because a peer exited). `disttrain_exit_code` ends the
    rank with that code once the error is recorded (a broken gloo group cannot be shut
    down cleanly): EXIT_HANG (124) for a timeout, 1 otherwise.
    """

    def __init__(self, message: str, entry: Entry, timed_out: bool):
        super().__init__(message)
        self.entry, self.timed_out = entry, timed_out
        self.disttrain_failure = "timeout" if timed_out else "peer-lost"
        self.disttrain_exit_code = EXIT_HANG if timed_out else 1


def recorder() -> FlightRecorder:
    """This process's flight recorder, created (and its watchdog started) on first use."""
    global _recorder
    with _lock:
        if _recorder is None or _recorder.pid != os.getpid():
            _recorder = FlightRecorder(
                dist.get_rank() if dist.is_initialized() else 0,
                dist.get_world_size() if dist.is_initialized() else 1,
                settings.current().timeout,
                settings.current().report_dir,
                attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                # NOTE: a forked child (DataLoader worker) must not take over the rank's live file
                live=_recorder is None,
            )
            _recorder.start_watchdog()
            atexit.register(_recorder.finish)
        return _recorder


def _check_ready(op: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(f"disttrain.comm.{op} needs a process group: call disttrain.init() "
                           "first (it works alone too, as a world of one)")


# NOTE: weak keys: a strong reference here would keep a destroyed process group (and its
# gloo threads) alive until interpreter exit, where tearing it down can abort the process.
_groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> (name, ranks)


def _group_info(group) -> tuple[str, tuple[int, ...]]:
    """(name, global ranks) of `group`, cached: this runs on every collective."""
    if group is None:
        group = dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):  # NOTE: before the lookup: weak keys only
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None (the world), "
                        f"got {type(group).__name__}; use mesh.group('dp') or dist.new_group(ranks)")
    hit = _groups.get(group)
    if hit is not None:
        return hit
    ranks = tuple(dist.get_process_group_ranks(group))
    name = "world" if group is dist.group.WORLD else f"group [{format_ranks(ranks)}]"
    _groups[group] = (name, ranks)
    return name, ranks


def _check_tensor(op: str, name: str, t) -> list[int]:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}; "
                        "wrap numbers with torch.tensor(...)")
    return list(t.shape)


def _check_rank(op: str, name: str, rank, ranks, group_name: str) -> None:
    if not isinstance(rank, int) or isinstance(rank, bool) or rank not in ranks:
        raise ValueError(f"{op}: {name}={rank!r} is not a global rank of {group_name} (ranks "
                         f"{format_ranks(ranks)}); pass a global rank in that group")


class RecordedWork:
    """Handle of an async recorded collective; `wait()` blocks until it completes."""

    def __init__(self, work, rec: FlightRecorder, entry: Entry, tracer=None):
        self._work, self._rec, self._entry, self._tracer = work, rec, entry, tracer
        try:  # NOTE: completes the record even if nobody calls wait() (DDP-style futures)
            work.get_future().add_done_callback(self._done)
        except (RuntimeError, AttributeError):
            pass

    def _done(self, fut) -> None:
        try:
            fut.value()
        except Exception:  # noqa: BLE001 - wait() reports it
            return
        self._rec.end(self._entry)
        if self._tracer is not None:
            self._tracer.finished(self._entry, exposed=False)

    def wait(self, timeout=None) -> bool:
        t0 = trace_hooks.now_us() if self._tracer is not None else 0.0
        try:
            ok = self._work.wait() if timeout is None else self._work.wait(timeout)
        except Exception as err:  # noqa: BLE001 - backend errors become CollectiveError
            raise _failed(self._rec, self._entry, err) from err
        self._rec.end(self._entry)
        if self._tracer is not None:  # the span (if the callback did not) and the exposed wait
            self._tracer.finished(self._entry, exposed=False)
            self._tracer.waited(self._entry, t0)
        return ok

    def __getattr__(self, name):
        return getattr(self._work, name)


def _failed(rec: FlightRecorder, entry: Entry, err: BaseException) -> CollectiveError:
    message = rec.fail(entry, err)
    return CollectiveError(message, entry, rec.status == "timeout")


def _run(op: str, call, group_name: str, ranks, shapes, dtype, async_op: bool):
    rec = recorder()
    entry = rec.start(op, group_name, ranks, shapes, str(dtype).replace("torch.", ""))
    tracer = trace_hooks.active  # NOTE: None unless tracing is on (disttrain.trace)
    if tracer is not None:
        tracer.issued(entry)
    try:
        work = call()
    except Exception as err:  # noqa: BLE001 - backend errors become CollectiveError
        raise _failed(rec, entry, err) from err
    if async_op:
        return RecordedWork(work, rec, entry, tracer)
    rec.end(entry)
    if tracer is not None:
        tracer.finished(entry, exposed=True)
    return work


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """Reduce `tensor` in place over `group` (blocks unless async_op)."""
    _check_ready("all_reduce")
    name, ranks = _group_info(group)
    shape = _check_tensor("all_reduce", "tensor", tensor)
    return _run("all_reduce", lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op),
                name, ranks, [shape], tensor.dtype, async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    """Copy `tensor` from global rank `src` to every rank of `group` (blocks unless async_op)."""
    _check_ready("broadcast")
    name, ranks = _group_info(group)
    shape = _check_tensor("broadcast", "tensor", tensor)
    _check_rank("broadcast", "src", src, ranks, name)
    return _run("broadcast", lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op),
                name, ranks, [shape], tensor.dtype, async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None,
               async_op: bool = False):
    """Gather every rank's `tensor` into `tensor_list` (blocks unless async_op)."""
    _check_ready("all_gather")
    name, ranks = _group_info(group)
    shape = _check_tensor("all_gather", "tensor", tensor)
    if not isinstance(tensor_list, (list, tuple)) or len(tensor_list) != len(ranks):
        got = len(tensor_list) if isinstance(tensor_list, (list, tuple)) else type(tensor_list).__name__
        raise ValueError(f"all_gather: tensor_list must be a list of {len(ranks)} tensors (one per "
                         f"rank of {name}), got {got}; use [torch.empty_like(t) for _ in range(n)]")
    for i, t in enumerate(tensor_list):
        if _check_tensor("all_gather", f"tensor_list[{i}]", t) != shape or t.dtype != tensor.dtype:
            raise ValueError(f"all_gather: tensor_list[{i}] is {t.dtype} {tuple(t.shape)} but tensor "
                             f"is {tensor.dtype} {tuple(shape)}; every slot must match the input "
                             "(use torch.empty_like(tensor))")
    return _run("all_gather", lambda: dist.all_gather(list(tensor_list), tensor, group=group,
                                                      async_op=async_op),
                name, ranks, [shape], tensor.dtype, async_op)


# NOTE: torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name
# warns); older releases only have the old one.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None,
                           async_op: bool = False):
    """Concatenate every rank's `input` along dim 0 into `output` (blocks unless async_op)."""
    _check_ready("all_gather_into_tensor")
    name, ranks = _group_info(group)
    shape = _check_tensor("all_gather_into_tensor", "input", input)
    _check_tensor("all_gather_into_tensor", "output", output)
    if output.numel() != input.numel() * len(ranks):
        raise ValueError(f"all_gather_into_tensor: output has {output.numel()} elements, needs "
                         f"{len(ranks)} x {input.numel()} (group size x input); resize it")
    return _run("all_gather_into_tensor",
                lambda: _all_gather(output, input, group=group, async_op=async_op),
                name, ranks, [shape], input.dtype, async_op)


# NOTE: torch 2.13 renamed reduce_scatter_tensor to reduce_scatter_single (the old name
# warns); older releases only have the old one.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM, group=None,
                          async_op: bool = False):
    """Reduce `input` over ranks and keep this rank's 1/N slice in `output` (blocks unless async_op)."""
    _check_ready("reduce_scatter_tensor")
    name, ranks = _group_info(group)
    shape = _check_tensor("reduce_scatter_tensor", "input", input)
    _check_tensor("reduce_scatter_tensor", "output", output)
    if input.numel() != output.numel() * len(ranks):
        raise ValueError(f"reduce_scatter_tensor: input has {input.numel()} elements, needs "
                         f"{len(ranks)} x {output.numel()} (group size x output); pad it")
    return _run("reduce_scatter_tensor",
                lambda: _reduce_scatter(output, input, op=op, group=group, async_op=async_op),
                name, ranks, [shape], input.dtype, async_op)


def barrier(group=None, async_op: bool = False):
    """Wait until every rank of `group` arrives (blocks unless async_op)."""
    _check_ready("barrier")
    name, ranks = _group_info(group)
    return _run("barrier", lambda: dist.barrier(group=group, async_op=async_op),
                name, ranks, [], "", async_op)


def _p2p(op: str, tensor, peer: int, group, call, async_op: bool, peer_name: str):
    _check_ready(op)
    name, ranks = _group_info(group)
    shape = _check_tensor(op, "tensor", tensor)
    _check_rank(op, peer_name, peer, ranks, name)
    me = dist.get_rank()
    if peer == me:
        raise ValueError(f"{op}: {peer_name}={peer} is this rank; point-to-point needs another rank")
    # NOTE: p2p is numbered per direction, not per group: message #k from 0 to 1 is the
    # sender's k-th send and the receiver's k-th receive (stages send different counts).
    src, dst = (me, peer) if op in ("send", "isend") else (peer, me)
    return _run(op, call, f"p2p {src}->{dst}", (src, dst), [shape], tensor.dtype, async_op)


def send(tensor: torch.Tensor, dst: int, group=None, tag: int = 0) -> None:
    """Send `tensor` to global rank `dst` (blocks until sent)."""
    _p2p("send", tensor, dst, group, lambda: dist.send(tensor, dst, group=group, tag=tag), False, "dst")


def recv(tensor: torch.Tensor, src: int, group=None, tag: int = 0) -> None:
    """Receive into `tensor` from global rank `src` (blocks until received)."""
    _p2p("recv", tensor, src, group, lambda: dist.recv(tensor, src, group=group, tag=tag), False, "src")


def isend(tensor: torch.Tensor, dst: int, group=None, tag: int = 0) -> RecordedWork:
    """Start sending `tensor` to `dst`; returns a handle (never blocks)."""
    return _p2p("isend", tensor, dst, group, lambda: dist.isend(tensor, dst, group=group, tag=tag),
                True, "dst")


def irecv(tensor: torch.Tensor, src: int, group=None, tag: int = 0) -> RecordedWork:
    """Start receiving into `tensor` from `src`; returns a handle (never blocks)."""
    return _p2p("irecv", tensor, src, group, lambda: dist.irecv(tensor, src, group=group, tag=tag),
                True, "src")
