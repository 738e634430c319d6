"""This process's trace: Chrome trace events as JSON lines in its own file, flushed as it goes.

One `Recorder` per traced process writes `DIR/rank{R}.a{A}.p{PID}.jsonl`: a header line
(rank, role, host, attempt, node and link rate when known), the measured clock offset,
then lines that each hold a JSON array of up to `LINE_EVENTS` events without their `pid`
(the merge adds it): spans, flow ends, instants and counters as compact rows (`rows.ROWS`
in rows.py, which makes them Chrome events again at the merge), metadata as whole events. Rows go
into a deque (an append is atomic: no lock on the training thread) that a daemon thread
empties into the file every `flush_s` seconds, so memory holds at most that much of the
trace and a rank that is killed loses at most the last fraction of a second; a
half-written last line is skipped by the merge (merge.py), so the merged trace stays
valid whatever happened.

NOTE: the hot path only appends a tuple of what it already has; everything that can be
derived later is derived at the merge: which communication lane a span goes on, the
exposed part of a blocking collective, a point-to-point message's flow arrow, a step's
breakdown. Rows, and one encoding per line rather than per event, because the encoding
was most of tracing's own cost: `json.dumps` of one span took 6-7 us here (a new encoder
per call, then the floats), a 512-row array 1.6 us a row.

Tracks (Chrome "threads" of the rank's process): 0 is the training thread (compute,
data waits, the exposed part of collectives), 100+k the k-th communication lane (each
collective from issue to completion; the merge puts overlapping ones on separate lanes
so every track nests), other Python threads get their own track under their name.

Steps: `begin_step()`/`note_optimizer()` (hooks.py) count steps; only steps inside the
window [first, last) are recorded (metadata and clock always are). Each closed step adds
one line to `metrics.rank{R}.a{A}.jsonl` (metrics.py) with the time breakdown, and its
`step N` span, both built by the writer thread.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import threading
import time
from itertools import islice

from disttrain import settings
from disttrain.trace.metrics import StepMetrics
from disttrain.trace.rows import COMM_TID, MAIN_TID, thread_meta

__all__ = ["Recorder", "cluster_meta", "now_us", "perf_us", "parse_steps", "MAIN_TID", "COMM_TID",
           "EPOCH_S", "WALL0_US", "LINE_EVENTS", "cost_meta"]

LINE_EVENTS = 512
_ENCODER = json.JSONEncoder(separators=(",", ":"), check_circular=False, default=repr)
EPOCH_S = 1_700_000_000
"""Wall-clock anchors count from this Unix time (from 1970 a double keeps only 0.25 µs)."""
_PERF0 = time.perf_counter()
WALL0_US = (time.time() - EPOCH_S) * 1e6
"""This process's wall clock (µs since EPOCH_S) when its `now_us()` read 0."""


def perf_us(perf: float) -> float:
    """A `time.perf_counter()` reading on the `now_us()` scale."""
    return (perf - _PERF0) * 1e6


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


def cluster_meta(environ=os.environ) -> dict:
    """Where this process runs, for the merge and the report: its node (`run --cluster`'s
    DISTTRAIN_CLUSTER_NODE, else its agent's GROUP_RANK in a multi-node job) and the link
    rate in Gbit/s that `run --cluster` exports (DISTTRAIN_LINK_GBPS), each when known."""
    s = settings.current() if environ is os.environ else settings.Settings.from_env(environ)
    out: dict = {}
    if s.cluster_node is not None:
        out["node"] = s.cluster_node
    else:
        try:
            if int(environ.get("GROUP_WORLD_SIZE") or 1) > 1 and environ.get("GROUP_RANK"):
                out["node"] = int(environ["GROUP_RANK"])
        except ValueError:
            pass
    if s.link_gbps is not None:
        out["link_gbps"] = s.link_gbps
    out["cost"] = cost_meta(s, environ)
    return out


def cost_meta(s: settings.Settings, environ=os.environ) -> dict:
    """The communication cost model's inputs this process knows (comm/cost.py's Links, read
    by `disttrain report` to say what bound each collective): ranks per node
    (LOCAL_WORLD_SIZE), this machine's CPUs, the emulated node's CPU quota (`run --cluster`
    exports DISTTRAIN_CLUSTER_CPUS when the cluster has --cpus-per-node) and every
    DISTTRAIN_* model number that is set; what is absent the report fills with named defaults."""
    out: dict = {"cpus": os.cpu_count() or 1}
    try:
        if environ.get("LOCAL_WORLD_SIZE"):
            out["local_ranks"] = int(environ["LOCAL_WORLD_SIZE"])
    except ValueError:
        pass
    if s.cluster_cpus is not None:
        out["node_cpus"] = s.cluster_cpus
    for key in ("alpha_us", "local_gbps", "local_alpha_us"):
        if getattr(s, key) is not None:
            out[key] = getattr(s, key)
    for key, env in (("step_us", settings.STEP_US), ("cpu_gbps", settings.CPU_GBPS),
                     ("cpu_local_gbps", settings.CPU_LOCAL_GBPS)):
        if environ.get(env):  # NOTE: these have numeric defaults; only a set one is recorded
            out[key] = getattr(s, key)
    if environ.get(settings.SHARED_CPU):
        out["shared_cpu"] = s.shared_cpu
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
                 attempt: int = 0, steps: tuple[int, int | None] = (0, None), flush_s: float = 0.5):
        os.makedirs(directory, exist_ok=True)
        self.directory, self.rank, self.world_size, self.attempt = directory, rank, world_size, attempt
        self.first, self.last = steps
        self.path = os.path.join(directory, f"rank{rank}.a{attempt}.p{os.getpid()}.jsonl")
        self.os_pid = os.getpid()
        self._fp = open(self.path, "w", encoding="utf-8")
        self._lock = threading.Lock()  # naming a new thread's track
        self._io = threading.Lock()  # the file: one flush at a time, in order
        self._buf: collections.deque = collections.deque()  # rows (ROWS) and whole events
        self.push = self._buf.append
        """Append one row (any thread; atomic: the hot path's only buffer operation)."""
        self._tids: dict[int, int] = {threading.main_thread().ident: MAIN_TID}
        self._ids: dict[str, int] = {}  # strings numbered in this file ("S" rows), from 1
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
        self._failed = False  # the writer raised (_safe_flush): nothing more is written
        self._thread = threading.Thread(target=self._flusher, args=(flush_s,),
                                        name="disttrain-trace-flush", daemon=True)
        self._thread.start()

    # ---- events ----

    def tid(self) -> int:
        """This thread's track, named on first use."""
        ident = threading.get_ident()
        tid = self._tids.get(ident)
        if tid is None:
            with self._lock:
                tid = self._tids.setdefault(ident, 10 + len(self._tids))
            self._meta_thread(tid, threading.current_thread().name)
        return tid

    def _sid(self, text: str) -> int:
        """`text`'s number in this file; the first time, an "S" row says it.

        NOTE: the row is in the buffer before the number is in `_ids`, so no thread can
        write a row that uses a number ahead of the row that defines it."""
        with self._lock:
            sid = self._ids.get(text)
            if sid is None:
                sid = len(self._ids) + 1
                self.push(("S", sid, text))
                self._ids[text] = sid
        return sid

    def _meta_thread(self, tid: int, name: str) -> None:
        self._buf.extend(thread_meta(tid, name))

    def complete(self, name: str, cat: str, t0: float, t1: float, args: dict | None = None,
                 tid: int | None = None) -> None:
        """An "X" span [t0, t1] on `tid` (default: the calling thread's track)."""
        if self.recording:
            self.push(("X", t0, max(0.0, t1 - t0), self.tid() if tid is None else tid, name, cat,
                       args or None))

    def comm_span(self, name: str, t0: float, t1: float, args: dict, flows=()) -> None:
        """A span from issue to completion on a communication lane, with flow arrow ends
        [(phase, id)] bound to it."""
        if self.recording:
            self.push(("L", t0, max(0.0, t1 - t0), name, "comm", args or None, list(flows) or None))

    def collective(self, t0: float, t1: float, entry, nbytes: int, exposed: bool = False) -> None:
        """A collective of comm/ops.py (a flight-recorder entry) from issue to completion;
        `exposed`: the calling thread blocked through all of it (one row either way)."""
        if self.recording:
            ids, op, group, site = self._ids, entry.op, entry.group, entry.site
            self.push(("K", t0, max(0.0, t1 - t0), ids.get(op) or self._sid(op),
                       ids.get(group) or self._sid(group), len(entry.ranks), entry.seq, nbytes,
                       ids.get(site) or self._sid(site), self.tid() if exposed else None))

    def bucket(self, b: int, ready: float, launched: float, done: float, nbytes: int) -> None:
        """Bucket `b` from ready to done, its reduction from `launched`, on a communication lane."""
        if self.recording:
            self.push(("B", ready, max(0.0, done - ready), b, nbytes, launched))

    def waited(self, name: str, t0: float, t1: float, op: str, group: str, seq: int) -> None:
        """The calling thread waited for collective (group, seq) from t0 to t1 (exposed)."""
        if self.recording:
            ids = self._ids
            self.push(("E", t0, max(0.0, t1 - t0), self.tid(), ids.get(name) or self._sid(name),
                       ids.get(op) or self._sid(op), ids.get(group) or self._sid(group), seq))

    def pipeline(self, rows: list) -> None:
        """Pipeline actions on the training thread: rows ("P", t0, dur, name, mb, chunk, stage)."""
        if self.recording:
            self._buf.extend(rows)

    def flow(self, phase: str, fid, ts: float, tid: int | None = None) -> None:
        """A flow arrow's end ("s" start, "f" finish) bound to the span around `ts` on `tid`."""
        if self.recording:
            self.push((phase, ts, self.tid() if tid is None else tid, fid))

    def instant(self, name: str, cat: str, args: dict | None = None, force: bool = False) -> None:
        if self.recording or force:
            self.push(("i", now_us(), self.tid(), name, cat, args or None))

    def counter(self, name: str, ts: float, values: dict) -> None:
        if self.recording:
            self.push(("C", ts, MAIN_TID, name, values))

    def set_clock(self, offset_us: float, error_us: float, rounds: int) -> None:
        """Record this clock's offset to rank 0's (add it to this file's timestamps)."""
        self.clock = {"offset_us": offset_us, "error_us": error_us, "rounds": rounds}
        self.push({"clock": self.clock})

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
        """Append the buffered events, and the closed steps' spans and metric lines, to the
        files (any thread; the writer thread every flush_s)."""
        with self._io:
            buf = self._buf
            pop = buf.popleft
            rows = [pop() for _ in range(len(buf))]  # NOTE: what other threads add meanwhile stays
            if self._closed:
                return
            for step, t0, t1, parts in self.metrics.flush():
                rows.append(("X", t0, max(0.0, t1 - t0), MAIN_TID, f"step {step}", "step", parts))
            if not rows:
                return
            try:
                it = iter(rows)
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
            self._safe_flush()

    def _safe_flush(self) -> None:
        """flush(), and on any error say so once and stop writing: the writer thread must go
        on emptying the deque (memory stays bounded) and training must not see the error."""
        try:
            self.flush()
        except Exception as err:  # noqa: BLE001 - reported here, once
            if not self._failed:
                print(f"disttrain trace: writer failed on rank {self.rank}: {type(err).__name__}: "
                      f"{err}; tracing stops", flush=True)
            self._failed = self._closed = True  # flush() now only empties the buffer

    def close(self) -> None:
        """Flush and close (idempotent; atexit calls it too)."""
        if os.getpid() != self.os_pid or self._fp.closed:
            return
        self._stop.set()
        self._safe_flush()
        with self._io:
            self._closed = True
            self._fp.close()
        if not self._failed:  # NOTE: the metric lines' own writer may be what failed
            self.metrics.close()
