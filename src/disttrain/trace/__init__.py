"""Tracing: one merged timeline of every rank, and per-step metrics.

    disttrain run --nproc 4 --trace out/ [--trace-steps 10:20] train.py
    # or, in code, on every rank after disttrain.init():
    disttrain.trace.start("out/", steps=(10, 20)); ...; disttrain.trace.stop()

Every traced process writes its own JSON-lines file in the folder (recorder.py): the
outermost forward, backward and optimizer step of the training thread (torch's global
hooks, hooks.py), data waits (`shard_loader`, or any iterable wrapped in `data()`), every
collective issued through `disttrain.comm` with its exposed part, and what the script
reports with `disttrain.log(loss=...)`. Clocks are aligned to rank 0's at start (clock.py).
`disttrain run` merges the files into `DIR/trace.json` (Chrome trace-event format: open
it in Perfetto's UI or chrome://tracing; a process per rank, a track for compute and
lanes for communication) and `DIR/metrics.jsonl` after the job, failed or not; `stop()`
does it itself when no launcher will (merge.py). `problems(trace)` checks a trace
against the format (check.py). Off, nothing is installed and the only cost is a test of
`hooks.active` per collective and per data-loader pass.

Who talks to whom: runtime.init() calls `on_init()` (starts tracing when `disttrain run
--trace` asked for it, aligns clocks); comm/ops.py and data.py call `hooks.active`.
More: docs/design/tracing.md.
"""

from __future__ import annotations

import atexit
import os

from disttrain import settings
from disttrain.trace import hooks
from disttrain.trace.check import problems
from disttrain.trace.merge import merge

__all__ = ["start", "stop", "is_active", "data", "log", "end_step", "merge", "problems",
           "parse_steps", "on_init", "clear"]

def parse_steps(text: str | None) -> tuple[int, int | None]:
    """'A:B' -> (A, B): record steps A..B-1 (either side may be empty: '5:', ':20')."""
    if not text:
        return 0, None
    first, sep, last = text.partition(":")
    try:
        a = int(first) if first.strip() else 0
        b = int(last) if last.strip() else None
    except ValueError:
        a, b, sep = -1, None, ""
    if not sep or a < 0 or (b is not None and b <= a):
        raise ValueError(f"trace steps {text!r}: give A:B with 0 <= A < B (steps A..B-1), "
                         "e.g. --trace-steps 10:20")
    return a, b


def clear(directory: str) -> None:
    """Create `directory` and remove a previous run's trace files from it (the launcher's job)."""
    import glob
    import shutil

    os.makedirs(directory, exist_ok=True)
    for pattern in ("rank*.jsonl", "metrics.rank*.jsonl", "trace.json", "metrics.jsonl"):
        for path in glob.glob(os.path.join(directory, pattern)):
            os.remove(path)
    shutil.rmtree(os.path.join(directory, "tensorboard"), ignore_errors=True)


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

    from disttrain import runtime

    window = parse_steps(steps) if isinstance(steps, str) or steps is None else tuple(steps)
    if runtime.role() == "server":  # NOTE: a PS server has no steps of its own: all of it
        window = (0, None)
    rec = Recorder(directory, runtime.rank(), runtime.world_size(), runtime.role(),
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


def on_init() -> None:
    """Called by disttrain.init() once the process group exists: start or align as asked."""
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


def end_step() -> None:
    """Mark the end of a training step (only for loops without a torch optimizer step)."""
    if hooks.active is not None:
        hooks.active.end_step()


def log(**values) -> None:
    """Attach scalars (loss=..., tokens=...) to this step's metrics line (ignored when off).

    `tokens`: tokens this rank's step processed (add up if logged more than once in a
    step); the line then has tokens_per_s. Other names: the last value of the step.
    """
    tracer = hooks.active
    if tracer is None:
        return
    scalars = {k: float(v.detach() if hasattr(v, "detach") else v) for k, v in values.items()}
    tracer.m.log(scalars)
    tracer.rec.counter("logged", hooks.now_us(), scalars)
