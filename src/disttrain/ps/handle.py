"""A pending push or pull (ps-lite's timestamp you `Wait` on), and `Cancelled`.

`Worker.push()` / `pull()` (worker.py) return a `Handle` at once. The compute thread
adds one outstanding reply per message it queues (`_add`) and seals the handle when the
op is fully queued (`_seal`); the worker's communication thread calls `_finish_one` as
each server's reply arrives. `wait()` blocks until all have, polling the worker for a
failure (a server error or silence past the timeout) so it never hangs. `Cancelled` is
raised by the worker when a server closed the round this worker was computing for.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from disttrain.ps.worker import Worker

__all__ = ["Handle", "Cancelled"]


class Cancelled(Exception):
    """This worker's round closed without it: abandon the step and pull() again."""


class Handle:
    """A pending push or pull. `done()` never blocks; `wait()` blocks until complete."""

    def __init__(self, worker: Worker, what: str):
        self._worker, self.what = worker, what
        self._lock = threading.Lock()
        self._outstanding = 0
        self._sealed = False
        self._event = threading.Event()
        self.result: dict = {}

    def _add(self, n: int = 1) -> None:
        with self._lock:
            self._outstanding += n

    def _finish_one(self) -> None:
        with self._lock:
            self._outstanding -= 1
            if self._sealed and self._outstanding <= 0:
                self._event.set()

    def _seal(self) -> Handle:
        with self._lock:
            self._sealed = True
            if self._outstanding <= 0:
                self._event.set()
        return self

    def done(self) -> bool:
        """True once every server answered (does not block)."""
        return self._event.is_set()

    def wait(self) -> Handle:
        """Block until every server answered; raises PSError if the job failed or a
        server stayed silent for the worker's timeout."""
        while not self._event.wait(0.05):
            self._worker._raise_if_failed(self.what)
        self._worker._raise_if_failed(self.what)
        return self
