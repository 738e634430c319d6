"""Flight recorder for collectives: every collective numbered, placed, and watched.

Who talks to whom:
- comm/ops.py calls `recorder().start(...)` before and `.end(entry)` after a collective
  (for `async_op=True`, when its future completes or `wait()` returns), and
  `.fail(entry, err)` when the backend raises (gloo raises after the group's timeout).
- `start` also writes the collective into this rank's live file (comm/live.py, a mapped
  file in the report folder) and `end` clears it, so where a rank waits is on disk the
  moment it waits, whenever and however the rank is stopped.
- The watchdog thread (daemon) writes the state to `$DISTTRAIN_REPORT_DIR/rank{R}.a{A}.json`
  whenever it changed (at most every `interval` seconds, so it costs nothing per
  collective); when a collective is overdue (timeout + grace) it writes a final dump with
  every thread's stack and ends the process with EXIT_HANG (os._exit: the main thread is
  stuck inside the backend and cannot unwind).
- `disttrain run` (launch/job.py) creates the report folder, passes it in the environment,
  and on a failed job merges every rank's file into one report (launch/hang_report.py).

More (the design and its reasons): docs/design/launcher.md, "Notes from comm/flight.py".
"""

from __future__ import annotations

import collections
import json
import os
import socket
import sys
import sysconfig
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field

from disttrain.comm.live import LiveSlots

__all__ = ["EXIT_HANG", "Entry", "FlightRecorder", "user_site", "is_library", "thread_stacks", "report_path"]

EXIT_HANG = 124
"""Exit code of a rank (and of `disttrain run`) whose collective did not complete."""

_DISTTRAIN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STDLIB_DIR = sysconfig.get_paths()["stdlib"] + os.sep
_SITE_DIRS = tuple({sysconfig.get_paths()[k] + os.sep for k in ("purelib", "platlib")})


_dirs_cache: list[tuple[str, ...]] = []


def _library_dirs() -> tuple[str, ...]:
    if _dirs_cache:
        return _dirs_cache[0]
    dirs = (_DISTTRAIN_DIR + os.sep,)
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "__file__", None):
        dirs += (os.path.dirname(torch.__file__) + os.sep,)
        _dirs_cache.append(dirs)  # final once torch is imported
    return dirs


def is_library(path: str, dirs: tuple[str, ...] | None = None) -> bool:
    """True for frames of disttrain, torch, the standard library and frozen modules."""
    if path.startswith(dirs if dirs is not None else _library_dirs()) or path.startswith("<frozen"):
        return True
    return path.startswith(_STDLIB_DIR) and not path.startswith(_SITE_DIRS)


def user_site(depth: int = 1) -> tuple[str, int, str]:
    """(file, line, function) of the innermost frame outside disttrain, torch and stdlib.

    Walks out from `depth` frames above this call (1: the caller's caller); falls back to
    the outermost frame. Cheap: a frame walk, no source lookup.
    """
    frame = sys._getframe(depth)
    dirs = _library_dirs()
    last = frame
    while frame is not None and is_library(frame.f_code.co_filename, dirs):
        last, frame = frame, frame.f_back
    frame = frame or last
    return frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name


def thread_stacks(skip_ident: int | None = None) -> dict[str, str]:
    """Every live thread's Python stack as text (most recent call last), by thread name."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = {}
    for ident, frame in sys._current_frames().items():
        if ident == skip_ident:
            continue
        name = names.get(ident, f"thread-{ident}")
        out[name] = "".join(traceback.format_stack(frame))
    return out


def report_path(report_dir: str, rank: int, attempt: int, suffix: str = "json") -> str:
    """Where rank `rank` of restart `attempt` writes its state (`suffix` json or stacks)."""
    return os.path.join(report_dir, f"rank{rank}.a{attempt}.{suffix}")


@dataclass
class Entry:
    """One collective as this rank issued it."""

    seq: int
    """Position of this collective in its group's (or peer pair's) sequence, from 1."""
    op: str
    """Operation name: all_reduce, broadcast, all_gather, barrier, send, recv, ..."""
    group: str
    """Which group: 'world', 'group [0-1]' (its global ranks), or 'p2p 0->1' (one direction)."""
    ranks: list[int] | tuple[int, ...]
    """Global ranks of the group (or the two peers), to name who is missing (shared, not copied)."""
    shapes: list[list[int]]
    dtype: str
    site: str
    """User call site 'path:line'."""
    func: str
    started: float
    """time.time() at issue."""
    ended: float | None = None
    extra: dict = field(default_factory=dict)

    def describe(self) -> str:
        return f"{self.op} #{self.seq} ({os.path.basename(self.site)})"


class FlightRecorder:
    """Per-process record of collectives plus the watchdog that reports overdue ones.

    `start`/`end`/`fail` never block on other ranks; they take a lock for a few
    microseconds. `write_state` does file I/O and is only called by the watchdog or on
    failure.
    """

    def __init__(self, rank: int, world_size: int, timeout: float, report_dir: str | None = None,
                 *, attempt: int = 0, keep: int = 16, grace: float | None = None,
                 interval: float | None = None, on_hang=None, live: bool = True):
        if timeout <= 0:
            raise ValueError(f"collective timeout must be > 0 seconds, got {timeout}")
        self.rank, self.world_size, self.timeout = rank, world_size, float(timeout)
        self.report_dir, self.attempt = report_dir, attempt
        # NOTE: the backend (gloo) times out at `timeout` itself and raises into fail();
        # the watchdog waits a little longer so that path, which unwinds the user's
        # code, wins whenever the backend has a timeout at all.
        self.grace = grace if grace is not None else min(max(2.0, 0.2 * self.timeout), 30.0)
        # NOTE: also how stale a stopped rank's state may be; the launcher says where the
        # ranks waited from it, so a rank stopped 0.3 s into a collective must show it.
        self.interval = interval if interval is not None else min(0.2, self.timeout / 10)
        self.pid = os.getpid()
        self.status = "running"
        self.error: str | None = None
        self._on_hang = on_hang or self._exit_hang
        self._lock = threading.Lock()
        self._seq: dict[str, int] = collections.defaultdict(int)
        # (group, op, site) -> times issued: tells which rank skipped which call.
        self._counts: dict[tuple[str, str, str], int] = collections.defaultdict(int)
        self._in_flight: dict[int, Entry] = {}
        self._recent: collections.deque[Entry] = collections.deque(maxlen=keep)
        self._version = 0
        self._written = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._live = self._open_live() if live and report_dir else None
        self._slots: dict[int, int] = {}  # id(entry) -> its live slot
        self._ranks_text: dict[str, str] = {}  # group -> format_ranks(its ranks)

    def _open_live(self) -> LiveSlots | None:
        path = report_path(self.report_dir, self.rank, self.attempt, "live")
        try:
            return LiveSlots(path)
        except (OSError, ValueError) as err:  # the JSON heartbeat still reports
            print(f"disttrain: cannot map {path}: {err}", file=sys.stderr, flush=True)
            return None

    # ---- recording (called around every collective) ----

    def start(self, op: str, group: str, ranks: list[int], shapes: list[list[int]],
              dtype: str = "") -> Entry:
        """Record a collective being issued; returns its entry (pass it to end/fail).

        Its site is the innermost frame outside disttrain/torch/stdlib, from the caller out.
        """
        path, line, func = user_site(2)
        with self._lock:
            self._seq[group] += 1
            entry = Entry(self._seq[group], op, group, ranks, shapes, dtype,
                          f"{path}:{line}", func, time.time())
            self._counts[(group, op, entry.site)] += 1
            self._in_flight[id(entry)] = entry
            self._version += 1
            if self._live is not None:
                text = self._ranks_text.get(group)
                if text is None:
                    text = self._ranks_text[group] = format_ranks(ranks)
                self._slots[id(entry)] = self._live.put(entry.seq, self._version, op, group, text,
                                                        func, entry.site)
        return entry

    def end(self, entry: Entry) -> None:
        """Record that `entry` completed (idempotent; any thread)."""
        with self._lock:
            if self._in_flight.pop(id(entry), None) is None:
                return
            if self._live is not None:
                self._live.clear(self._slots.pop(id(entry), -1))
            entry.ended = time.time()
            self._recent.append(entry)
            self._version += 1

    def fail(self, entry: Entry, err: BaseException) -> str:
        """Record that the backend raised inside `entry`; dump state; return a message."""
        timed_out = "timed out" in str(err).lower() or "timeout" in type(err).__name__.lower()
        with self._lock:
            self.status = "timeout" if timed_out else "failed"
            self.error = f"{type(err).__name__}: {str(err).strip()[:500]}"
            # NOTE: stays in flight (the report places the rank by it) but the watchdog
            # leaves it alone: the error is unwinding the user's code already.
            entry.extra["failed"] = True
        self.write_state(stacks=True)
        return self.explain(entry, timed_out, err)

    def explain(self, entry: Entry, timed_out: bool, err: BaseException | None = None) -> str:
        where = f"{entry.describe()} on {entry.group} (ranks {format_ranks(entry.ranks)})"
        if timed_out:
            why = (f"did not complete within {self.timeout:g} s on rank {self.rank}: the other "
                   f"ranks did not join it. Look for the rank that skipped this {entry.op}, called "
                   "another collective, or is stuck elsewhere; `disttrain run` prints where every "
                   "rank is. Raise the limit with `disttrain run --timeout S` or DISTTRAIN_TIMEOUT")
        else:
            why = (f"failed on rank {self.rank}: {str(err).strip()[:300]}. A peer probably left, "
                   "crashed or issued a different collective; see the other ranks' errors")
        return f"{where} {why}."

    # ---- state ----

    def in_flight(self) -> list[Entry]:
        with self._lock:
            return sorted(self._in_flight.values(), key=lambda e: e.started)

    def overdue(self, now: float | None = None) -> Entry | None:
        """The oldest in-flight collective older than timeout + grace, if any."""
        now = time.time() if now is None else now
        flying = [e for e in self.in_flight() if not e.extra.get("failed")]
        if flying and now - flying[0].started > self.timeout + self.grace:
            return flying[0]
        return None

    def snapshot(self, stacks: bool = False) -> dict:
        """This rank's state as plain JSON-able data."""
        with self._lock:
            data = {
                "rank": self.rank, "world_size": self.world_size, "pid": self.pid,
                "host": socket.gethostname(), "attempt": self.attempt, "time": time.time(),
                "timeout": self.timeout, "status": self.status, "error": self.error,
                "in_flight": [asdict(e) for e in sorted(self._in_flight.values(),
                                                        key=lambda e: e.started)],
                "recent": [asdict(e) for e in self._recent],
                "counts": [[g, op, site, n] for (g, op, site), n in self._counts.items()],
                "version": self._version,
            }
        if stacks:
            data["stacks"] = thread_stacks(skip_ident=threading.get_ident()
                                           if threading.current_thread() is self._thread else None)
        return data

    def write_state(self, stacks: bool = False) -> dict:
        """Write the snapshot atomically to the report folder (if any); return it."""
        data = self.snapshot(stacks)
        if self.report_dir:
            path = report_path(self.report_dir, self.rank, self.attempt)
            tmp = f"{path}.tmp{threading.get_ident()}"
            try:
                with open(tmp, "w") as fp:
                    json.dump(data, fp)
                os.replace(tmp, path)
            except OSError as err:  # a full disk must not kill training
                print(f"disttrain: cannot write {path}: {err}", file=sys.stderr, flush=True)
        self._written = data["version"]
        return data

    def finish(self) -> None:
        """Record a normal exit (atexit): the launcher then knows this rank ended."""
        if os.getpid() != self.pid:  # a forked child (DataLoader worker) is not this rank
            return
        with self._lock:
            if self.status == "running":
                self.status = "exited"
        self.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)  # NOTE: its last write must not land after ours
        self.write_state()

    # ---- watchdog ----

    def start_watchdog(self) -> None:
        """Start the daemon thread (idempotent). Never blocks."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="disttrain-watchdog",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            late = self.overdue()
            if late is not None:
                with self._lock:
                    self.status = "timeout"
                    self.error = f"watchdog: {late.describe()} overdue"
                self.write_state(stacks=True)
                self._on_hang(late)
                return
            if self.report_dir and self._version != self._written:
                self.write_state()

    def _exit_hang(self, entry: Entry) -> None:
        print(f"disttrain: rank {self.rank}: {self.explain(entry, True)}", file=sys.stderr)
        if not self.report_dir:  # no launcher will merge reports: print this rank's stack
            for name, stack in thread_stacks(threading.get_ident()).items():
                print(f"disttrain: rank {self.rank} thread {name}:\n{stack}", file=sys.stderr)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(EXIT_HANG)


def format_ranks(ranks) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    ranks = sorted(set(ranks))
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(parts)
