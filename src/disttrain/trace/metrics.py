"""Per-step metrics of one traced process: one JSON line per step in `metrics.rank{R}.a{A}.jsonl`.

The hooks (hooks.py) feed the training thread's time into the open step as it happens:
data waits, compute spans (forward, backward, optimizer step: the outermost ones), the
exposed communication (collectives the training thread waited for, synchronous ones whole
and the `wait()` of async ones) and how much of it happened inside a compute span. When
the step closes, its line says, in seconds:

    step_time = compute + exposed_comm + data + idle

where compute excludes the exposed communication inside it and idle is what no span
covered (the loop's own Python, logging, a loader disttrain does not see). Also: bytes
and counts per collective kind (from any thread), samples and samples/s (from the batches
`disttrain.trace.data` / `shard_loader` delivered), peak memory, what the script gave
`disttrain.log(...)` during the step (loss, ...; `tokens` add up: tokens/s), and on PS
workers the versions pulled (staleness bound, updates/s). The merge (merge.py) joins every
rank's file into `DIR/metrics.jsonl`, sorted by step then rank.
"""

from __future__ import annotations

import json
import os
import sys
import threading

__all__ = ["StepMetrics"]


def _cuda_peak() -> int | None:
    """CUDA's max allocated bytes when this process uses a GPU, else None (a cheap test)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    return None


def _peak_rss() -> int:
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except (ImportError, OSError):
        return 0


_PARTS = ("step_time", "compute", "exposed_comm", "data", "idle")


def _breakdown(step_us: float, compute: float, in_compute: float, exposed: float, data: float) -> dict:
    """A step's time (sums in µs) in seconds; compute less the exposed communication inside it."""
    compute = max(0.0, compute - in_compute)
    return {"step_time": step_us / 1e6, "compute": compute / 1e6, "exposed_comm": exposed / 1e6,
            "data": data / 1e6, "idle": (step_us - compute - exposed - data) / 1e6}


class StepMetrics:
    """The open step's sums (microseconds) and the file its closed steps go to."""

    def __init__(self, directory: str, rank: int, attempt: int, world_size: int):
        self.rank, self.world_size, self.attempt = rank, world_size, attempt
        self.path = os.path.join(directory, f"metrics.rank{rank}.a{attempt}.jsonl")
        self._fp = None
        self._pending: list[tuple] = []  # closed steps' sums, their lines not yet written
        self._lock = threading.Lock()
        self._ps_prev: float | None = None  # the parameter version of the previous push
        self.reset()

    def reset(self) -> None:
        self.data = self.compute = self.exposed = self.exposed_in_compute = 0.0
        self.samples = self.tokens = 0
        self.ps: dict = {}
        self.pipeline_busy = self.pipeline_wall = 0.0
        self.waits: dict[str, float] = {}
        self.bytes: dict[str, int] = {}
        self.counts: dict[str, int] = {}
        self.logged: dict = {}

    def log(self, values: dict) -> None:
        """`disttrain.log(...)`'s scalars: `tokens` add up over the step, others replace."""
        for k, v in values.items():
            if k == "tokens":
                self.tokens += v
            else:
                self.logged[k] = v

    def ps_pushed(self, versions) -> None:
        """A PS worker pushed the gradient it computed on `versions` (one per server): the
        servers' updates since its previous push, beyond its own, bound the staleness."""
        if not versions or min(versions) < 0:
            return
        v = sum(versions) / len(versions)
        self.ps = {"ps_version": v}
        if self._ps_prev is not None:
            self.ps.update(ps_updates=v - self._ps_prev, ps_staleness=max(0.0, v - self._ps_prev - 1))
        self._ps_prev = v

    def close_step(self, step: int, t0: float, t1: float, record: bool) -> None:
        """Queue the line of the step [t0, t1] (µs, this clock) when `record`; start the next.

        NOTE: the training thread only keeps the step's sums (reset() makes new dicts, so
        most are not copied: bytes and counts are, a collective's completion callback may
        still add to them); the writer thread builds and writes the line (`line()`)."""
        if record:
            with self._lock:
                self._pending.append((step, t0, t1, self.data, self.compute, self.exposed,
                                      self.exposed_in_compute, self.samples, self.tokens, self.ps,
                                      self.waits, self.pipeline_busy, self.pipeline_wall, dict(self.bytes),
                                      dict(self.counts), self.logged, _cuda_peak()))
        self.reset()

    def line(self, sums: tuple, rss: int = 0) -> dict:
        """A closed step's metrics line from what close_step kept (`rss`: the peak RSS, for a
        step that ran on no GPU)."""
        (step, t0, t1, data, compute, exposed, in_compute, samples, tokens, ps, waits, busy, wall,
         nbytes, counts, logged, peak) = sums
        if peak is None:
            peak = rss
        line = {"step": step, "rank": self.rank, "attempt": self.attempt, "t0_us": t0,
                **_breakdown(t1 - t0, compute, in_compute, exposed, data)}
        secs = max(1e-9, line["step_time"])
        if samples:
            line.update(samples=samples, samples_per_s=samples / secs)
        if tokens:
            line.update(tokens=tokens, tokens_per_s=tokens / secs)
        line.update(ps)
        if "ps_updates" in ps:
            line["ps_updates_per_s"] = ps["ps_updates"] / secs
        if waits:  # named parts of idle (an injected delay, a checkpoint save)
            line["idle_named"] = {k: v / 1e6 for k, v in waits.items()}
        if wall > 0:
            line["pipeline_bubble"] = max(0.0, 1.0 - busy / wall)
        line["bytes"], line["collectives"], line["peak_memory_bytes"] = nbytes, counts, peak
        line.update(logged)
        return line

    def flush(self) -> list[tuple]:
        """Append the closed steps' lines to the file (the recorder's flush calls it); their
        (step, t0, t1, breakdown) for the trace's `step N` spans."""
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return []
        # NOTE: the peak RSS is read here, not when the step closed: a system call the training
        # thread made every step (1.2 us hot here, more under load); a high-water mark read up
        # to flush_s later is the step's or more
        rss = _peak_rss()
        lines = [self.line(sums, rss) for sums in pending]
        try:
            if self._fp is None:
                self._fp = open(self.path, "a", encoding="utf-8")
            self._fp.write("".join(json.dumps(line, separators=(",", ":"), default=repr) + "\n"
                                   for line in lines))
            self._fp.flush()
        except (OSError, ValueError):
            pass  # the trace file's writer reports a full disk once
        return [(sums[0], sums[1], sums[2], {k: line[k] for k in _PARTS})
                for sums, line in zip(pending, lines)]

    def close(self) -> None:
        self.flush()
        if self._fp is not None:
            self._fp.close()
            self._fp = None
