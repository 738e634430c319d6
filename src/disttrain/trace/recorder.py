"""This process's trace: Chrome trace events as JSON lines in its own file, flushed as it goes.

One `Recorder` per traced process writes `DIR/rank{R}.a{A}.p{PID}.jsonl`: a header line
(rank, role, host, attempt, node and link rate when known), then one JSON object per line: trace events without their
`pid` (the merge adds it), thread names, and the measured clock offset. Events are kept in
a small buffer that a daemon thread appends to the file every `flush_s` seconds (and any
thread does when it holds `max_buffer` events), so memory stays bounded and a rank that
is killed loses at most the last fraction of a second; a half-written last line is
skipped by the merge (merge.py), so the merged trace stays valid whatever happened.

Tracks (Chrome "threads" of the rank's process): 0 is the training thread (compute,
data waits, the exposed part of collectives), 100+k the k-th communication lane (each
collective from issue to completion; overlapping ones go to separate lanes so every
track nests), other Python threads get their own track under their name.

Steps: `begin_step()`/`note_optimizer()` (hooks.py) count steps; only steps inside the
window [first, last) are recorded (metadata and clock always are). Each closed step adds
one line to `metrics.rank{R}.a{A}.jsonl` (metrics.py) with the time breakdown.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

from disttrain.trace.metrics import StepMetrics

__all__ = ["Recorder", "cluster_meta", "now_us", "perf_us", "MAIN_TID", "COMM_TID", "EPOCH_S", "WALL0_US"]

MAIN_TID = 0
COMM_TID = 100
EPOCH_S = 1_700_000_000
"""Wall-clock anchors count from this Unix time (from 1970 a double keeps only 0.25 µs)."""
_PERF0 = time.perf_counter()
WALL0_US = (time.time() - EPOCH_S) * 1e6
"""This process's wall clock (µs since EPOCH_S) when its `now_us()` read 0."""


def perf_us(perf: float) -> float:
    """A `time.perf_counter()` reading on the `now_us()` scale."""
    return (perf - _PERF0) * 1e6


def cluster_meta(environ=os.environ) -> dict:
    """Where this process runs, for the merge and the report: its node (`run --cluster`'s
    DISTTRAIN_CLUSTER_NODE, else its agent's GROUP_RANK in a multi-node job) and the link
    rate in Gbit/s that `run --cluster` exports (DISTTRAIN_LINK_GBPS), each when known."""
    out: dict = {}
    try:
        if environ.get("DISTTRAIN_CLUSTER_NODE"):
            out["node"] = int(environ["DISTTRAIN_CLUSTER_NODE"])
        elif int(environ.get("GROUP_WORLD_SIZE") or 1) > 1 and environ.get("GROUP_RANK"):
            out["node"] = int(environ["GROUP_RANK"])
        if environ.get("DISTTRAIN_LINK_GBPS"):
            out["link_gbps"] = float(environ["DISTTRAIN_LINK_GBPS"])
    except ValueError:
        pass
    return out


def now_us() -> float:
    """Microseconds on this process's monotonic clock (0 at import; WALL0_US on the wall clock).

    NOTE: small numbers on purpose: spans keep sub-microsecond precision, and the merge
    adds one constant per process (its wall anchor and measured offset), so the ends of
    adjacent spans stay equal and tracks nest exactly.
    """
    return (time.perf_counter() - _PERF0) * 1e6


class Recorder:
    """Buffers this process's events and appends them to its file (see the module docstring)."""

    def __init__(self, directory: str, rank: int, world_size: int, role: str = "worker",
                 attempt: int = 0, steps: tuple[int, int | None] = (0, None),
                 flush_s: float = 0.5, max_buffer: int = 20000):
        os.makedirs(directory, exist_ok=True)
        self.directory, self.rank, self.world_size, self.attempt = directory, rank, world_size, attempt
        self.first, self.last = steps
        self.path = os.path.join(directory, f"rank{rank}.a{attempt}.p{os.getpid()}.jsonl")
        self.os_pid, self.max_buffer = os.getpid(), max_buffer
        self._fp = open(self.path, "w", encoding="utf-8")
        self._lock = threading.Lock()  # the buffer and tracks (held for an append)
        self._io = threading.Lock()  # the file: one flush at a time, in order
        self._buf: list[dict] = []
        self._tids: dict[int, int] = {threading.main_thread().ident: MAIN_TID}
        self._lanes: list[float] = []
        self.step, self.recording = 0, self.first <= 0 and (self.last is None or self.last > 0)
        self.metrics = StepMetrics(directory, rank, attempt, world_size)
        self.clock: dict | None = None
        self._write_now({"disttrain_trace": 1, "rank": rank, "world_size": world_size,
                         "role": role, "attempt": attempt, "host": socket.gethostname(),
                         "os_pid": self.os_pid, "steps": [self.first, self.last], "epoch_s": EPOCH_S, "wall0_us": WALL0_US,
                         "started_us": now_us(), **cluster_meta()})
        self._meta_thread(MAIN_TID, "compute (training thread)")
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._flusher, args=(flush_s,),
                                        name="disttrain-trace-flush", daemon=True)
        self._thread.start()

    # ---- events ----

    def _emit(self, event: dict) -> None:
        with self._lock:
            self._buf.append(event)
            full = len(self._buf) >= self.max_buffer
        if full:
            self.flush()

    def tid(self) -> int:
        """This thread's track, named on first use."""
        ident = threading.get_ident()
        tid = self._tids.get(ident)
        if tid is None:
            with self._lock:
                tid = self._tids.setdefault(ident, 10 + len(self._tids))
            self._meta_thread(tid, threading.current_thread().name)
        return tid

    def _meta_thread(self, tid: int, name: str) -> None:
        self._emit({"ph": "M", "name": "thread_name", "tid": tid, "args": {"name": name}})
        self._emit({"ph": "M", "name": "thread_sort_index", "tid": tid, "args": {"sort_index": tid}})

    def complete(self, name: str, cat: str, t0: float, t1: float, args: dict | None = None,
                 tid: int | None = None) -> None:
        """An "X" span [t0, t1] on `tid` (default: the calling thread's track)."""
        if not self.recording:
            return
        event = {"ph": "X", "name": name, "cat": cat, "ts": t0, "dur": max(0.0, t1 - t0),
                 "tid": self.tid() if tid is None else tid}
        if args:
            event["args"] = args
        self._emit(event)

    def lane(self, t0: float, t1: float) -> int:
        """The track of the first communication lane free from `t0`, taken until `t1`.

        NOTE: a lane's end only grows (a span goes where the last one ended before it
        starts), so spans on a lane never overlap, whatever order they are recorded in.
        """
        with self._lock:
            for lane, end in enumerate(self._lanes):
                if end <= t0:
                    self._lanes[lane], new = t1, False
                    break
            else:
                lane, new = len(self._lanes), True
                self._lanes.append(t1)
        if new:
            self._meta_thread(COMM_TID + lane, "comm" if lane == 0 else f"comm {lane + 1}")
        return COMM_TID + lane

    def comm_span(self, name: str, t0: float, t1: float, args: dict, flows=()) -> None:
        """A collective from issue to completion on the first communication lane it fits."""
        if not self.recording:
            return
        tid = self.lane(t0, t1)
        self.complete(name, "comm", t0, t1, args, tid)
        for phase, fid in flows:  # (phase "s"/"f", id): bound to this span
            self.flow(phase, fid, t0 if phase == "s" else t1 - min(1.0, (t1 - t0) / 2), tid)

    def flow(self, phase: str, fid, ts: float, tid: int | None = None) -> None:
        """A flow arrow's end ("s" start, "f" finish) bound to the span around `ts` on `tid`."""
        if self.recording:
            self._emit({"ph": phase, "name": "flow", "cat": "flow", "id": fid, "bp": "e", "ts": ts,
                        "tid": self.tid() if tid is None else tid})

    def instant(self, name: str, cat: str, args: dict | None = None, force: bool = False) -> None:
        if self.recording or force:
            self._emit({"ph": "i", "s": "t", "name": name, "cat": cat, "ts": now_us(),
                        "tid": self.tid(), **({"args": args} if args else {})})

    def counter(self, name: str, ts: float, values: dict) -> None:
        if self.recording:
            self._emit({"ph": "C", "name": name, "ts": ts, "tid": MAIN_TID, "args": values})

    def set_clock(self, offset_us: float, error_us: float, rounds: int) -> None:
        """Record this clock's offset to rank 0's (add it to this file's timestamps)."""
        self.clock = {"offset_us": offset_us, "error_us": error_us, "rounds": rounds}
        self._emit({"clock": self.clock})

    # ---- steps ----

    def enter_step(self, step: int) -> None:
        """Step `step` begins: record it or not, as the window says."""
        self.step = step
        self.recording = step >= self.first and (self.last is None or step < self.last)

    # ---- file ----

    def _write_now(self, obj: dict) -> None:
        self._fp.write(json.dumps(obj, separators=(",", ":")) + "\n")
        self._fp.flush()

    def flush(self) -> None:
        """Append the buffered events to the file (any thread; blocks on file I/O only).

        NOTE: the events are encoded outside the buffer's lock: holding it through the
        encoding stalled every span the training thread emitted meanwhile (pp's traced
        step time grew much more than its CPU time)."""
        with self._io:
            with self._lock:
                buf, self._buf = self._buf, []
            if self._closed or not buf:
                return
            try:
                self._fp.write("".join(json.dumps(e, separators=(",", ":")) + "\n" for e in buf))
                self._fp.flush()
            except (OSError, ValueError) as err:  # a full disk must not kill training
                self._closed = True
                print(f"disttrain trace: cannot write {self.path}: {err}; tracing stops on rank "
                      f"{self.rank}", flush=True)

    def _flusher(self, every: float) -> None:
        while not self._stop.wait(every):
            self.flush()

    def close(self) -> None:
        """Flush and close (idempotent; atexit calls it too)."""
        if os.getpid() != self.os_pid or self._fp.closed:
            return
        self._stop.set()
        self.flush()
        with self._io:
            self._closed = True
            self._fp.close()
        self.metrics.close()
