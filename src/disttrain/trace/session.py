"""This process's tracing: `start`, `stop`, and what the training loop calls while it runs.

`disttrain.trace.start(DIR)` installs the tracer (hooks.py) writing this process's file
(recorder.py) and aligns its clock to rank 0's (clock.py); `stop()` closes it and, without
a launcher that will, merges (merge.py). `data()` and `is_active()` are the
loop's side (`end_step()` and `log()`: events.py).

Who talks to whom: runtime.init() tells `on_init(rank, world_size, role)` who this
process is, once the process group exists; it starts tracing when `disttrain run
--trace` asked for it and aligns clocks. Tracing asks nobody: a later `start()` uses
what it was told (else torch.distributed's rank, as a worker).
"""

from __future__ import annotations

import atexit
import os

from disttrain import settings
from disttrain.trace import hooks
from disttrain.trace.merge import merge
from disttrain.trace.recorder import parse_steps

__all__ = ["start", "stop", "is_active", "data", "on_init"]

_told: dict = {}  # NOTE: who this process is, as runtime.init() said (rank, world_size, role)


def is_active() -> bool:
    return hooks.active is not None


def start(directory: str, steps: tuple[int, int | None] | str | None = None, align: bool = True) -> None:
    """Start tracing this process into `directory` (a collective once initialized: every rank calls it).

    `steps` (A, B) or 'A:B' records only steps A..B-1 (counted from 0 by optimizer steps).
    `align=False` traces only the ranks that call it (say, a parameter server's workers):
    no clock alignment (a collective of every rank); their clocks are taken as equal.
    """
    from disttrain.trace.recorder import Recorder

    if hooks.active is not None:
        raise RuntimeError(f"tracing is already on (into {hooks.active.rec.directory}); "
                           "call disttrain.trace.stop() first")
    import torch.distributed as dist

    rank, world_size, role = _identity(dist)
    window = parse_steps(steps) if isinstance(steps, str) or steps is None else tuple(steps)
    if role == "server":  # NOTE: a PS server has no steps of its own: all of it
        window = (0, None)
    rec = Recorder(directory, rank, world_size, role,
                   int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), window)
    tracer = hooks.Tracer(rec)
    tracer.install()
    hooks.active = tracer
    atexit.register(_at_exit, tracer)
    if dist.is_initialized() and align:
        _align(rec)
    elif not align:
        rec.set_clock(0.0, 0.0, 0)


def _align(rec) -> None:
    from disttrain.trace.clock import align

    align(rec)


def _identity(dist) -> tuple[int, int, str]:
    """(rank, world size, role): as runtime.init() told, else torch.distributed's, a worker."""
    if _told:
        return _told["rank"], _told["world_size"], _told["role"]
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), "worker"
    return 0, 1, "worker"


def on_init(rank: int, world_size: int, role: str) -> None:
    """Called by disttrain.init() once the process group exists, telling who this process
    is ('worker' or 'server'): start tracing or align its clock, as asked."""
    _told.update(rank=rank, world_size=world_size, role=role)
    s = settings.current()
    if hooks.active is None and s.trace_dir:
        start(s.trace_dir, s.trace_steps)
    elif hooks.active is not None and hooks.active.rec.clock is None:
        _align(hooks.active.rec)


def _at_exit(tracer) -> None:
    if hooks.active is tracer:
        hooks.active = None
        tracer.finish()
        tracer.rec.close()


def stop(merge_files: bool = True) -> str | None:
    """Stop tracing (every rank calls it); without `disttrain run --trace`, rank 0 merges.

    Returns the merged trace's path on the rank that wrote it, else None.
    `merge_files=False`: only this process stops (no barrier, no merge; `merge(DIR)` later).
    """
    tracer = hooks.active
    if tracer is None:
        return None
    hooks.active = None
    tracer.finish()
    tracer.rec.close()
    if settings.current().trace_dir or not merge_files:
        return None  # the launcher merges after the job (or the caller, when it wants)
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()  # NOTE: every rank's file is closed before rank 0 reads them
    if tracer.rec.rank == 0:
        return merge(tracer.rec.directory)["path"]
    return None


def data(iterable):
    """`iterable` with each wait for its next item traced as data loading (itself when off)."""
    return iterable if hooks.active is None else hooks.active.data(iterable)
