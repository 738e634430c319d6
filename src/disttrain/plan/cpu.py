"""Processor sharing of a machine's cores between the simulated workers' compute.

When a job's processes share a few cores (an emulated cluster on one machine), a
worker's compute runs slower while others compute at the same time. This is the
processor-sharing model of an operating system's time-slicing scheduler (Kleinrock
1967): n tasks on c cores, with `background` other processes always runnable, each
progress at min(1, c / (n + background)) seconds of work per second. A task's work is
given as the seconds it took when it ran alone beside the same background (how it is
measured: a one-worker run), i.e. at min(1, c / (1 + background)).

Used by plan/simulate.py (`Compute.cores`); the straggler delay, a sleep, holds no core.
Pure Python: the caller owns the clock; `next_done()` says when to call `finish()`.
"""

from __future__ import annotations

import math

__all__ = ["SharedCores"]


class SharedCores:
    """The CPU work in progress on `cores` cores shared with `background` processes."""

    def __init__(self, cores: float, background: float = 0.0):
        if not (math.isfinite(cores) and cores > 0):
            raise ValueError(f"cores must be a finite number > 0, got {cores}")
        if not (math.isfinite(background) and background >= 0):
            raise ValueError(f"background processes must be a finite number >= 0, got {background}")
        self.cores, self.background = cores, background
        self.alone = min(1.0, cores / (1.0 + background))  # the rate the work was measured at
        self.work: dict[int, float] = {}  # task -> seconds of work left, at rate 1
        self.last = 0.0
        self.token = 0  # NOTE: bumped whenever the set changes; an older next_done is void

    def rate(self) -> float:
        """Seconds of work each task does per second now."""
        return min(1.0, self.cores / (len(self.work) + self.background))

    def _advance(self, t: float) -> None:
        if self.work:
            done = (t - self.last) * self.rate()
            for task in self.work:
                self.work[task] -= done
        self.last = t

    def add(self, t: float, task: int, seconds_alone: float) -> None:
        """Start `task` at `t`: `seconds_alone` is its duration when run alone."""
        self._advance(t)
        self.work[task] = seconds_alone * self.alone
        self.token += 1

    def remove(self, t: float, task: int) -> None:
        """Abandon `task` at `t` (a cancel); nothing if it is not running."""
        if task in self.work:
            self._advance(t)
            del self.work[task]
            self.token += 1

    def next_done(self) -> float | None:
        """When the first task in progress ends if nothing changes (None if idle)."""
        if not self.work:
            return None
        return self.last + min(self.work.values()) / self.rate()

    def finish(self, t: float) -> list[int]:
        """Advance to `t` and remove and return the tasks whose work is done."""
        self._advance(t)
        done = [task for task, left in self.work.items() if left <= 1e-12 * (1 + t)]
        for task in done:
            del self.work[task]
        if done:
            self.token += 1
        return done
