"""What the strategies tell the trace: one call at each point, a no-op when tracing is off.

Each function tests `hooks.active` first and returns at once when it is None, so a call
site costs one function call with tracing off. Who calls what:

- parallel/pipeline/runtime.py: `pipeline_begin()` before each schedule and
  `pipeline_step(spans, t0, stage)` after it, with the runtime's own F/B/W timings
  (perf_counter seconds from t0): one span per action and micro-batch on the training
  thread (the step's compute: the module hooks skip the stage meanwhile), and the step's
  bubble (1 - busy / wall) added to the step's metrics. The receives' waits and the send -> receive arrows come from
  comm/ops.py already (irecv/isend).
- ps/handle.py: `ps_issued(handle)` / `ps_done(handle)` / `ps_waited(handle, t0)`: a push
  or pull from issue to its last answer on a communication lane, and the part the caller
  waited for; ps/worker.py: `ps_cancelled(rank)`, `ps_sleep(...)` around an injected
  straggler delay; ps/server.py: `span("apply" / "receive" / "answer", "ps")`, and
  `ps_server_stats(stats)` once at the end (staleness histogram, updates).
- the user's script: `log(loss=...)` (`disttrain.log`), `end_step()`
  (`disttrain.trace.end_step`).
- checkpoint: `span("checkpoint.save")`, `span("checkpoint.load")`; comm/reducer.py:
  `stamp()`s and `bucket(...)` per bucket, `waiting(...)` around algorithm futures.
"""

from __future__ import annotations

import contextlib
import functools

from disttrain.trace import hooks
from disttrain.trace.hooks import now_us
from disttrain.trace.recorder import perf_us

__all__ = ["now_us", "end_step", "log", "span", "traced", "instant", "stamp", "bucket",
           "waiting", "ps_pushed", "pipeline_begin",
           "ps_pulling", "ps_received", "ps_applied", "pipeline_step", "ps_issued", "ps_done", "ps_waited",
           "ps_cancelled", "ps_server_stats"]

_OFF = contextlib.nullcontext()


NAMED_IDLE = ("user", "injected", "checkpoint")
"""Categories whose spans on the training thread are named parts of idle in the metrics."""


@contextlib.contextmanager
def _span(tracer, name: str, cat: str, args: dict):
    t0 = now_us()
    try:
        yield
    finally:
        t1 = now_us()
        tracer.rec.complete(name, cat, t0, t1, args or None)
        if cat in NAMED_IDLE:
            tracer.named_wait(name, t0, t1)


def span(name: str, cat: str = "user", **args):
    """A context manager timing its block as a span on this thread's track."""
    tracer = hooks.active
    return _OFF if tracer is None else _span(tracer, name, cat, args)


def traced(name: str, cat: str):
    """Decorator: each call of the function is a span `name` (when tracing is on)."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            tracer = hooks.active
            if tracer is None:
                return fn(*args, **kwargs)
            with _span(tracer, name, cat, {}):
                return fn(*args, **kwargs)
        return call
    return wrap


def end_step() -> None:
    """A training step ended now: for loops without a torch optimizer step (PS workers:
    the push). `disttrain.trace.end_step()`."""
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
    tracer.rec.counter("logged", now_us(), scalars)


def instant(name: str, cat: str = "user", **args) -> None:
    """A point in time on this thread's track."""
    tracer = hooks.active
    if tracer is not None:
        tracer.rec.instant(name, cat, args or None)


def stamp() -> float | None:
    """now_us() while tracing is on, else None (comm/reducer.py's bucket times)."""
    return None if hooks.active is None else now_us()


def bucket(b: int, ready: float | None, start: float | None, nbytes: int) -> None:
    """Bucket `b` of DataParallel or ZeRO (comm/reducer.py) was waited for now: its last
    gradient arrived at `ready`, its reduction launched at `start` (`stamp()`s). One span
    `bucket b` [ready, now] on a communication lane with `reduce` [start, now] inside."""
    tracer = hooks.active
    if tracer is None or ready is None or start is None or not tracer.rec.recording:
        return
    tracer.rec.bucket(b, ready, start, now_us(), nbytes)


def waiting(result, op: str):
    """A future's blocking `result()` whose waits count as exposed communication `wait {op}`
    (comm/reducer.py's futures: their collective runs on the group's algorithm thread)."""
    def wait(timeout=None):
        tracer = hooks.active
        if tracer is None:
            return result(timeout)
        t0 = now_us()
        try:
            return result(timeout)
        finally:
            tracer.exposed(f"wait {op}", t0, now_us(), {"op": op})
    return wait


def pipeline_begin() -> None:
    """The pipeline runtime starts a step's schedule on the training thread: the first work
    after an optimizer step opens a step, and until `pipeline_step` its F/B/W spans stand
    for the compute: the
    module and backward hooks skip the stage's modules (NOTE: they measured about 40 % of
    tracing's cost in a 2-stage pipeline, for spans that repeated the runtime's own)."""
    tracer = hooks.active
    if tracer is not None and tracer.on_main():
        tracer.begin(now_us())
        tracer.own_compute = True


def pipeline_step(spans, t0: float, stage: int) -> None:
    """The pipeline runtime's actions of one step (F/B/W, micro-batch, chunk; seconds from `t0`)."""
    tracer = hooks.active
    if tracer is None:
        return
    end = now_us()
    base = perf_us(t0)
    done = [(base + s.start * 1e6, base + s.end * 1e6) for s in spans]
    tracer.rec.pipeline([("P", a, b - a, f"{s.kind}{s.microbatch}", s.microbatch, s.chunk, stage)
                         for s, (a, b) in zip(spans, done)])
    busy = sum(b - a for a, b in done)
    if tracer.on_main():
        tracer.pipeline_compute(done, busy)
    tracer.m.pipeline_busy += busy
    tracer.m.pipeline_wall += max(0.0, end - base)


def ps_issued(handle) -> None:
    tracer = hooks.active
    if tracer is not None:
        handle.trace_t0 = now_us()


def ps_done(handle) -> None:
    """Every server answered `handle` (any thread): its span, with flow arrows (see below)."""
    tracer = hooks.active
    t0 = getattr(handle, "trace_t0", None)
    if tracer is not None and t0 is not None:
        handle.trace_t0 = None
        flows = getattr(handle, "trace_flows", None)
        flows = flows() if callable(flows) else ()
        tracer.rec.comm_span(handle.what, t0, now_us(), {"op": handle.what, "ps": True}, flows)


# Flow arrows push -> apply -> pull: a push of worker w at clock c to server s starts
# "push s{s} w{w} c{c}", which ends in the server's apply span that used it; that apply
# (making version v) starts "apply s{s} v{v}", which ends in every pull that got v.
_received: dict[tuple[int, int], tuple[int, int]] = {}  # (server, push id) -> (worker, clock)


def ps_pushed(handle, worker: int, clock: int, versions: list[int]) -> None:
    """A worker's push (and its step) ends; its span will start an arrow to each server.
    `versions`: per server, the parameter version its gradient was computed on."""
    if hooks.active is not None:
        handle.trace_flows = lambda: [("s", f"push s{s} w{worker} c{clock}") for s in range(len(versions))]
        hooks.active.m.ps_pushed(versions)
        hooks.active.end_step()


def ps_pulling(handle, versions: list[int]) -> None:
    """A pull; `versions` (updated as answers land) names the applies its span ends arrows of."""
    if hooks.active is not None:
        handle.trace_flows = lambda: [("f", f"apply s{s} v{v}") for s, v in enumerate(versions)]


def ps_received(server: int, push: int, worker: int, clock: int) -> None:
    if hooks.active is not None:
        _received[(server, push)] = (worker, clock)


def ps_applied(server: int, pushes, version: int) -> None:
    """Inside a server's apply span: end the pushes' arrows, start the version's."""
    tracer = hooks.active
    if tracer is None:
        return
    t = now_us()
    for p in pushes:
        got = _received.pop((server, p), None)
        if got is not None:
            tracer.rec.flow("f", f"push s{server} w{got[0]} c{got[1]}", t)
    tracer.rec.flow("s", f"apply s{server} v{version}", t)


def ps_waited(handle, t0: float) -> None:
    """The caller blocked in `handle.wait()` from `t0` until now."""
    tracer = hooks.active
    if tracer is not None:
        tracer.exposed(f"wait {handle.what}", t0, now_us(), {"op": handle.what, "ps": True})


def ps_cancelled(rank: int) -> None:
    instant("cancel", "ps", worker=rank)


def ps_server_stats(stats: dict) -> None:
    """A server's final counters (staleness histogram, updates) as one instant event."""
    tracer = hooks.active
    if tracer is not None:
        keep = {k: v for k, v in stats.items() if isinstance(v, (int, float, str, dict))}
        if isinstance(keep.get("staleness"), dict):
            keep["staleness"] = {str(k): v for k, v in keep["staleness"].items()}
        tracer.rec.instant("ps server stats", "ps", keep, force=True)
