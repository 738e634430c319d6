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
does it itself when no launcher will (session.py, merge.py). `problems(trace)` checks a trace
against the format (check.py). Off, nothing is installed and the only cost is a test of
`hooks.active` per collective and per data-loader pass.

Who talks to whom: runtime.init() tells session.py's `on_init(rank, world_size, role)`
who this process is (it starts tracing when `disttrain run --trace` asked for it, aligns
clocks); comm/ops.py and data.py call `hooks.active`; the launcher calls merge.py's
`clear` and `merge`. More: docs/design/tracing.md.
"""

from disttrain.deprecation import moved
from disttrain.trace.check import problems
from disttrain.trace.events import end_step
from disttrain.trace.merge import merge
from disttrain.trace.session import data, is_active, start, stop

__all__ = ["start", "stop", "is_active", "data", "end_step", "merge", "problems"]

# NOTE: deprecated for one release: internals of the launcher and of disttrain.init(), and
# a second name of disttrain.log.
__getattr__ = moved(__name__, {"log": "disttrain:log", "on_init": "disttrain.trace.session:on_init",
                               "clear": "disttrain.trace.merge:clear",
                               "parse_steps": "disttrain.trace.recorder:parse_steps"})
