"""`disttrain.preempted()`: the job was told to stop, and every rank learns it at the same step.

A Slurm or Kubernetes job gets SIGTERM some seconds before it is killed. Each rank sees
a signal at a different moment, so a rank that tests a local flag would stop at its own
step and the checkpoint would mix steps (or the others would wait in a collective for
it). The ranks must agree: `preempted()` returns the OR over every rank of "I saw the
notice", taken from one reduction all ranks ran together.

Who talks to whom:
- `disttrain run` (launch/job.py), on SIGTERM, sends PREEMPT_SIGNAL (SIGUSR2) to every
  rank that registered (a `rank{R}.a{A}.preempt` file, written at the first call of
  `preempted()`), waits `--grace-seconds`, then stops the ranks. Under torchrun or srun
  the notice is SIGTERM itself.
- The signal handler here only sets `_state.seen`.
- DataParallel (parallel/data_parallel.py) adds one element to its last gradient bucket
  when its group is the whole world: `flag_value()` goes in, the summed element comes
  back through `deliver()`. No extra collective, no extra round trip.
- `preempted()` reads the last delivered sum; when no such reduction ran since its last
  call (pipeline, tensor parallel, ZeRO, a loop without DataParallel, the first call) it
  runs one small all-reduce (MAX) over the world itself.
Why (and what each mode costs): docs/design/launcher.md, "Preemption".
"""

from __future__ import annotations

import os
import signal
import socket
import threading

import torch
import torch.distributed as dist

from disttrain import runtime, settings

__all__ = ["preempted", "PREEMPT_SIGNAL", "flag_value", "deliver", "marker_path"]

PREEMPT_SIGNAL = signal.SIGUSR2
"""What `disttrain run` sends a rank to say "save and stop" (SIGTERM from the agent means
"stop now": a peer failed)."""


class _State:
    seen = False  # this rank got the notice (set by the signal handler only)
    agreed = False  # some rank got it: agreed through a reduction; sticky
    delivered: torch.Tensor | None = None  # a reduced flag not read by preempted() yet
    installed = False


_state = _State()


def flag_value() -> float:
    """This rank's contribution to the piggybacked flag: 1.0 once it saw the notice."""
    return 1.0 if _state.seen else 0.0


def deliver(total: torch.Tensor) -> None:
    """A world-wide reduction carried the flag: `total` (one element, the sum over every
    rank of `flag_value()`) is what `preempted()` reads next. Read lazily (no sync here)."""
    _state.delivered = total


def marker_path(report_dir: str, rank: int, attempt: int) -> str:
    """The file that tells `disttrain run` this rank handles the notice (holds pid and host)."""
    return os.path.join(report_dir, f"rank{rank}.a{attempt}.preempt")


def preempted() -> bool:
    """True once the job was told to stop (SIGTERM to `disttrain run`, or to the ranks under
    torchrun/srun), on every rank at the same call. Call it at the same point of every
    step on every rank (after the backward, once per optimizer step).

    Blocks only when no world-wide DataParallel reduction carried the flag since the last
    call: then it runs one small all-reduce over all ranks (a collective: every rank must
    call it). The first call also installs the signal handler (from the main thread).
    Parameter-server jobs: each worker sees its own notice (workers share no step).
    """
    if not _state.installed:
        _install()
    if _state.agreed:
        return True
    if not dist.is_initialized() or dist.get_world_size() == 1 or runtime.num_servers() > 0:
        _state.agreed = _state.seen
        return _state.agreed
    total, _state.delivered = _state.delivered, None
    if total is None:  # NOTE: nothing carried it since the last call: ask once, together
        from disttrain.comm import ops

        total = torch.tensor([flag_value()], device=runtime.device())
        ops.all_reduce(total, op=dist.ReduceOp.MAX)
    _state.agreed = bool(total.item() > 0)
    return _state.agreed


def _notice_signal() -> signal.Signals:
    name = settings.current().preempt_signal
    return signal.Signals[name] if name else signal.SIGTERM


def _install() -> None:
    """Handle the notice signal; register with `disttrain run` (its report folder)."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("disttrain.preempted() must first be called from the main thread "
                           "(it installs the signal handler there)")
    sig = _notice_signal()
    previous = signal.getsignal(sig)

    def handler(signum, frame):
        _state.seen = True
        if callable(previous):  # NOTE: a handler the script installed before keeps running
            previous(signum, frame)

    signal.signal(sig, handler)
    _state.installed = True
    s = settings.current()
    if s.report_dir and s.preempt_signal:
        path = marker_path(s.report_dir, runtime.rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
        with open(path, "w") as fp:
            fp.write(f"{os.getpid()} {socket.gethostname()}\n")
