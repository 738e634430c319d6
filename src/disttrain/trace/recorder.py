"""This process's trace: Chrome trace events as JSON lines in its own file, flushed as it goes.

One `Recorder` per traced process writes `DIR/rank{R}.a{A}.p{PID}.jsonl`: a header line
(rank, role, host, attempt, node and link rate when known), the measured clock offset,
then lines that each hold a JSON array of up to `LINE_EVENTS` events without their `pid`
(the merge adds it): spans, flow ends, instants and counters as compact rows (`ROWS`
below; `expand()` makes them Chrome events again), metadata as whole events. Events are
kept in a small buffer that a daemon thread appends to the file every `flush_s` seconds
(and any thread does when it holds `max_buffer` events), so memory stays bounded and a
rank that is killed loses at most the last fraction of a second; a half-written last
line is skipped by the merge (merge.py), so the merged trace stays valid whatever happened.

NOTE: rows, and one encoding per line rather than per event, because the encoding was
most of tracing's own cost: `json.dumps` of one span took 6-7 us here (a new encoder per
call, then the floats), a 512-row array 1.6 us a row.

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
from itertools import islice

from disttrain.trace.metrics import StepMetrics

__all__ = ["Recorder", "cluster_meta", "now_us", "perf_us", "expand", "MAIN_TID", "COMM_TID",
           "EPOCH_S", "WALL0_US", "ROWS", "LINE_EVENTS"]

MAIN_TID = 0
COMM_TID = 100
LINE_EVENTS = 512
ROWS = {
    "X": ("ts", "dur", "tid", "name", "cat", "args"),
    "i": ("ts", "tid", "name", "cat", "args"),
    "s": ("ts", "tid", "id"),
    "f": ("ts", "tid", "id"),
    "C": ("ts", "tid", "name", "args"),
    "K": ("ts", "dur", "tid", "op", "group", "ranks", "seq", "bytes", "site"),
    "E": ("ts", "dur", "tid", "name", "op", "group", "seq"),
    "P": ("ts", "dur", "name", "microbatch", "chunk", "stage"),
}
"""Compact rows [kind, *fields]: Chrome phases X, i, s, f, C (`args` may be null: none), and
three spans without key names, the most frequent ones: K a collective (cat comm, name
= op), E the caller's wait for one (cat comm.exposed), P a pipeline action (cat
pipeline, training thread)."""
_ARGS = {"K": ("op", "group", "ranks", "seq", "bytes", "site"), "E": ("op", "group", "seq"),
         "P": ("microbatch", "chunk", "stage")}
_SPAN = {"K": "comm", "E": "comm.exposed", "P": "pipeline"}
_ENCODER = json.JSONEncoder(separators=(",", ":"), check_circular=False, default=repr)
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


def expand(row) -> dict | None:
    """A Chrome trace event from one element of a line: a row (`ROWS`) or a whole event;
    None for anything else."""
    if isinstance(row, dict):
        return row
    fields = ROWS.get(row[0]) if isinstance(row, list) and row and isinstance(row[0], str) else None
    if fields is None or len(row) != len(fields) + 1:
        return None
    kind, event = row[0], dict(zip(fields, row[1:]))
    if kind in _SPAN:
        event = {"ph": "X", "name": event.get("name", event.get("op")), "cat": _SPAN[kind],
                 "ts": event["ts"], "dur": event["dur"], "tid": event.get("tid", MAIN_TID),
                 "args": {k: event[k] for k in _ARGS[kind]}}
        return event
    event["ph"] = kind
    if event.get("args") is None:
        event.pop("args", None)
    if kind == "i":
        event["s"] = "t"
    elif kind in ("s", "f"):
        event.update(name="flow", cat="flow", bp="e")
    return event


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
        self._buf: list = []  # rows (ROWS) and whole events
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

    def _emit(self, event) -> None:
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
        if self.recording:
            self._emit(("X", t0, max(0.0, t1 - t0), self.tid() if tid is None else tid, name, cat,
                        args or None))

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
        """A span from issue to completion on the first communication lane it fits."""
        if self.recording:
            self.rows(self._comm_rows(("X", t0, max(0.0, t1 - t0), self.lane(t0, t1), name, "comm", args),
                                      flows))

    def collective(self, t0: float, t1: float, entry, nbytes: int, flows=(), exposed: bool = False) -> None:
        """A collective of comm/ops.py (a flight-recorder entry) from issue to completion on
        a communication lane, with its flow ends, and when `exposed` (the caller blocked
        through all of it) its exposed span on the caller's track: one append."""
        if self.recording:
            dur = max(0.0, t1 - t0)
            rows = self._comm_rows(("K", t0, dur, self.lane(t0, t1), entry.op, entry.group,
                                    len(entry.ranks), entry.seq, nbytes, entry.site), flows)
            if exposed:
                rows.append(("E", t0, dur, self.tid(), entry.op, entry.op, entry.group, entry.seq))
            self.rows(rows)

    @staticmethod
    def _comm_rows(span: tuple, flows) -> list:
        t0, dur, tid = span[1], span[2], span[3]
        return [span] + [(phase, t0 if phase == "s" else t0 + dur - min(1.0, dur / 2), tid, fid)
                         for phase, fid in flows]  # (phase "s"/"f", id): bound to this span

    def rows(self, rows: list) -> None:
        """Append several rows at once (one lock)."""
        with self._lock:
            self._buf.extend(rows)
            full = len(self._buf) >= self.max_buffer
        if full:
            self.flush()

    def waited(self, name: str, t0: float, t1: float, op: str, group: str, seq: int) -> None:
        """The calling thread waited for collective (group, seq) from t0 to t1 (exposed)."""
        if self.recording:
            self._emit(("E", t0, max(0.0, t1 - t0), self.tid(), name, op, group, seq))

    def pipeline(self, rows: list) -> None:
        """Pipeline actions on the training thread: rows ("P", t0, dur, name, mb, chunk, stage)."""
        if self.recording:
            self.rows(rows)

    def flow(self, phase: str, fid, ts: float, tid: int | None = None) -> None:
        """A flow arrow's end ("s" start, "f" finish) bound to the span around `ts` on `tid`."""
        if self.recording:
            self._emit((phase, ts, self.tid() if tid is None else tid, fid))

    def instant(self, name: str, cat: str, args: dict | None = None, force: bool = False) -> None:
        if self.recording or force:
            self._emit(("i", now_us(), self.tid(), name, cat, args or None))

    def counter(self, name: str, ts: float, values: dict) -> None:
        if self.recording:
            self._emit(("C", ts, MAIN_TID, name, values))

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
            if self._closed:
                return
            self.metrics.flush()
            if not buf:
                return
            try:
                it = iter(buf)
                while chunk := list(islice(it, LINE_EVENTS)):
                    self._fp.write(_ENCODER.encode(chunk) + "\n")
                self._fp.flush()
            except (OSError, ValueError, TypeError, RecursionError) as err:
                # NOTE: a full disk (or a span's args that cannot be encoded) must not kill training
                self._closed = True
                print(f"disttrain trace: cannot write {self.path}: {type(err).__name__}: {err}; "
                      f"tracing stops on rank {self.rank}", flush=True)

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
