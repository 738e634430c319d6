"""A pending push or pull (ps-lite's timestamp you `Wait` on), `Cancelled` and `PSError`.

`Worker.push()` / `pull()` (worker.py) return a `Handle` at once. The compute thread
adds one outstanding reply per message it queues (`add`) and seals the handle when the
op is fully queued (`seal`); the worker's communication thread calls `finish_one` as
each server's reply arrives. `wait()` blocks until all have, calling the `check` it was
given (the worker's failure check: a server error or silence past the timeout raises)
so it never hangs; the handle never sees the worker itself. `Cancelled` is raised by
the worker when a server closed the round this worker was computing for; `PSError`, by
either side when the job cannot go on (also importable from disttrain.ps.server).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from disttrain.trace import events as trace_events

__all__ = ["Handle", "Cancelled", "PSError"]


class Cancelled(Exception):
    """This worker's round closed without it: abandon the step and pull() again."""


class PSError(RuntimeError):
    """The parameter-server job cannot go on (lost worker in Sync, dead server...)."""


class Handle:
    """A pending push or pull. `done()` never blocks; `wait()` blocks until complete."""

    def __init__(self, check: Callable[[str], None], what: str, detail: str = ""):
        """check(what) raises if the operation can no longer complete (never blocks);
        `detail` says which one, for errors (e.g. "clock 3")."""
        self._check, self.what, self.detail = check, what, detail
        self._lock = threading.Lock()
        self._outstanding = 0
        self._sealed = False
        self._event = threading.Event()
        self.result: dict = {}
        trace_events.ps_issued(self)

    def add(self, n: int = 1) -> None:
        """Expect `n` more replies (does not block)."""
        with self._lock:
            self._outstanding += n

    def finish_one(self) -> None:
        """One reply arrived (any thread; does not block)."""
        with self._lock:
            self._outstanding -= 1
            if self._sealed and self._outstanding <= 0:
                self._event.set()
                trace_events.ps_done(self)

    def seal(self) -> Handle:
        """Every message of the operation is queued: no more `add` (does not block)."""
        with self._lock:
            self._sealed = True
            if self._outstanding <= 0:
                self._event.set()
                trace_events.ps_done(self)
        return self

    def done(self) -> bool:
        """True once every server answered (does not block)."""
        return self._event.is_set()

    def wait(self) -> Handle:
        """Block until every server answered; raises PSError if the job failed or a
        server stayed silent for the worker's timeout."""
        t0 = trace_events.now_us()
        while not self._event.wait(0.05):
            self._check(self.what)
        self._check(self.what)
        trace_events.ps_waited(self, t0)
        return self
