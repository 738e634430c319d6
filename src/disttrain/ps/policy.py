"""Consistency policies of a parameter server: pure objects fed events, answering decisions.
Follows ps-lite's server-side consistency (Li et al. 2014) and SSP (Ho et al. 2013).

More (the design and its reasons): docs/design/parameter-server.md, "Notes from ps/policy.py".
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from disttrain.ps.staleness import UpdateRule, mean_staleness

__all__ = [
    "Decision",
    "Policy",
    "Sync",
    "KSync",
    "KBatchSync",
    "Async",
    "KAsync",
    "KBatchAsync",
    "SSP",
    "backup_workers",
]


@dataclass
class Decision:
    """What the server must do after one event, in this order."""

    apply: list[int] = field(default_factory=list)
    """push ids whose gradients are averaged and applied as one optimizer step."""
    drop: list[int] = field(default_factory=list)
    """push ids thrown away (computed on a version whose round already closed)."""
    cancel: list[int] = field(default_factory=list)
    """workers whose in-flight work on an old version must be abandoned."""
    release: list[int] = field(default_factory=list)
    """workers whose parked pull may now be answered with the current parameters."""
    error: str | None = None
    """the job cannot go on (e.g. Sync lost a worker); the server stops with this."""
    staleness: list[int] = field(default_factory=list)
    """staleness of each push in `apply`, in the same order (versions behind the server)."""


class Policy:
    """Base policy: bookkeeping shared by every mode. Subclasses set the rules.

    Rules are three class attributes plus `_need()`: `cancels` (close a round by
    cancelling the others and dropping late gradients), `per_batch` (a worker may push
    several minibatches per version and never waits after a push), `tolerates_loss`.
    """

    cancels = False
    per_batch = False
    tolerates_loss = True
    rule = UpdateRule()
    """How the server steps stale gradients (staleness.py); the asynchronous policies take
    it as options, `step=` and `momentum=`."""

    def __init__(self) -> None:
        self.version = 0
        self.live: set[int] = set()
        self.clock: Counter[int] = Counter()
        self.last_version: dict[int, int] = {}
        self.parked: set[int] = set()
        self.buffer: list[tuple[int, int, int]] = []  # (push id, worker, version)
        self.staleness: Counter[int] = Counter()
        self.dropped = 0
        self.applied = 0
        self.lost_workers: list[int] = []

    def __repr__(self) -> str:
        args = {**self._args(), **{k: repr(v) for k, v in vars(self.rule).items()
                                   if v != getattr(type(self).rule, k)}}
        return f"{type(self).__name__}({', '.join(f'{k}={v}' for k, v in args.items())})"

    def _args(self) -> dict[str, int]:
        return {}

    # ---- events -------------------------------------------------------------------
    def start(self, workers: list[int]) -> None:
        """The job's workers; called once by the server before any other event."""
        if not workers:
            raise ValueError("a parameter server needs at least one worker")
        self.live = set(workers)

    def push(self, pid: int, worker: int, version: int) -> Decision:
        """Worker `worker` pushed a complete gradient computed on `version` (id `pid`)."""
        self.clock[worker] += 1
        self.last_version[worker] = version
        if self.cancels and version < self.version:
            self.dropped += 1
            return Decision(drop=[pid], release=self._releasable())
        self.buffer.append((pid, worker, version))
        return self._maybe_close()

    def applies_alone(self) -> bool:
        """True when the next push will be applied on its own as soon as it is complete,
        never averaged or dropped (Async, SSP, K = 1 without cancelling): a server may then
        step each chunk of it as it arrives."""
        return not self.cancels and not self.buffer and self._need() == 1

    def runs_ahead(self) -> bool:
        """True when a round may hold a push whose worker is already free to compute and
        push again (a per-batch policy, or KAsync's pushes left for the next round; k > 1):
        with copies a server says `held` on such a push's receipt and acknowledges it once
        its round is on every copy, so no worker waits on a round it does not wait for."""
        return getattr(self, "k", 1) > 1 and (self.per_batch or not self.cancels)

    def pull(self, worker: int) -> Decision:
        """Worker asks for parameters; answered now (release) or parked until allowed."""
        self.parked.add(worker)
        return Decision(release=self._releasable())

    def leave(self, worker: int) -> Decision:
        """Worker finished its work cleanly and will push no more. Its pushes already in
        the round stay there: the round still waits for the other live workers."""
        self.live.discard(worker)
        self.parked.discard(worker)
        out = self._maybe_close()
        if not self.live and self.buffer:
            # NOTE: only per-batch policies get here (their rounds need k minibatches);
            # the last worker left, so fewer than k can never become k: counted dropped
            out.drop = [pid for pid, _, _ in self.buffer]
            self.dropped += len(self.buffer)
            self.buffer = []
        return out

    def lost(self, worker: int) -> Decision:
        """Worker stopped answering (killed, crashed, partitioned)."""
        if worker not in self.live:
            return Decision()
        self.lost_workers.append(worker)
        if not self.tolerates_loss:
            self.live.discard(worker)
            return Decision(error=(
                f"worker {worker} was lost and {self!r} needs every worker each round; "
                "use KSync/KBatchSync/Async/SSP to tolerate lost workers"))
        return self.leave(worker)

    # ---- rules ----------------------------------------------------------------------
    def _need(self) -> int:
        """Gradients that close a round."""
        raise NotImplementedError

    def _round_workers(self) -> int:
        """Workers the round counts: the live ones and those that left (done or lost)
        after pushing into it, whose gradients it holds."""
        return len(self.live | {w for _, w, _ in self.buffer})

    def _may_start(self, worker: int) -> bool:
        """May `worker` get parameters now (for its next computation)?"""
        if self.per_batch:
            return True
        last = self.last_version.get(worker)
        return last is None or self.version > last

    def _maybe_close(self) -> Decision:
        out = Decision()
        if self.buffer and len(self.buffer) >= self._need():
            # NOTE: a round is summed in worker order (a worker's own pushes in the order
            # it sent them), never in arrival order: float addition is not associative,
            # so this makes every update bitwise the same however the pushes raced
            self.buffer.sort(key=lambda b: (b[1], b[0]))
            out.apply = [pid for pid, _, _ in self.buffer]
            out.staleness = [self.version - v for _, _, v in self.buffer]
            contributors = {w for _, w, _ in self.buffer}
            self.staleness.update(out.staleness)
            self.applied += len(self.buffer)
            self.buffer = []
            self.version += 1
            if self.cancels:
                others = self.live if self.per_batch else self.live - contributors
                out.cancel = sorted(others)
        out.release = self._releasable()
        return out

    def _releasable(self) -> list[int]:
        ready = sorted(w for w in self.parked if self._may_start(w))
        self.parked.difference_update(ready)
        return ready

    def open_round(self) -> dict:
        """The open round, for a waiting worker's error (pong; plain types, no blocking):
        its version, the [worker, version] of each push it holds, the pushes that close
        it and the live workers."""
        return {"version": self.version, "pushes": [[w, v] for _, w, v in self.buffer],
                "need": self._need(), "live": sorted(self.live)}

    def mean_staleness(self) -> float:
        """Mean staleness of the gradients applied so far (0 before the first)."""
        return mean_staleness(self.staleness)

    def stats(self) -> dict:
        """Counters for the job report (plain types, msgpack/JSON-safe)."""
        return {"policy": repr(self), "version": self.version, "applied": self.applied,
                "dropped": self.dropped, "lost_workers": list(self.lost_workers),
                "staleness": {int(k): int(v) for k, v in sorted(self.staleness.items())}}


# NOTE: the default for every policy that applies stale gradients (docs/benchmarks.md,
# "Staleness-aware updates": measured against the other rules)
STALE_DEFAULT = UpdateRule(step="inverse-staleness", momentum="as-given")


def _check_k(k: int) -> int:
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    return k


class _KPolicy(Policy):
    def __init__(self, k: int):
        super().__init__()
        self.k = _check_k(k)

    def _args(self) -> dict[str, int]:
        return {"k": self.k}

    def start(self, workers: list[int]) -> None:
        super().start(workers)
        if not self.per_batch and self.k > len(workers):
            raise ValueError(f"{self!r} waits for {self.k} workers per round but the job has "
                             f"{len(workers)}; use k <= {len(workers)} (or more --workers)")

    def _need(self) -> int:
        # NOTE: once workers are lost or done, a round closes with those still live plus
        # those whose push it already holds (never early: their pushes are in flight)
        return max(1, min(self.k, self._round_workers())) if not self.per_batch else self.k


class Sync(Policy):
    """Fully synchronous (BSP): apply once every live worker pushed; a lost worker is an error.
    A worker that leaves after pushing into a round is applied with the others' pushes."""

    cancels = True
    tolerates_loss = False

    def _need(self) -> int:
        return max(1, self._round_workers())


class KSync(_KPolicy):
    """Apply the first k gradients of a round; cancel the other workers (Dutta et al. 2018)."""

    cancels = True


class KBatchSync(_KPolicy):
    """Apply after k minibatches from any workers; finished workers keep going on the same
    version; the round's close cancels everyone still on the old version."""

    cancels = True
    per_batch = True


class KAsync(_KPolicy):
    """Apply the first k gradients (any version); nobody is cancelled (Dutta et al. 2018).
    `step`, `momentum`: how stale gradients are stepped (staleness.py)."""

    rule = STALE_DEFAULT

    def __init__(self, k: int, *, step: str = STALE_DEFAULT.step,
                 momentum: str = STALE_DEFAULT.momentum):
        super().__init__(k)
        self.rule = UpdateRule(step, momentum)


class KBatchAsync(_KPolicy):
    """Apply every k minibatches (any version); workers never wait, nobody is cancelled.
    `step`, `momentum`: how stale gradients are stepped (staleness.py)."""

    per_batch = True
    rule = STALE_DEFAULT

    def __init__(self, k: int, *, step: str = STALE_DEFAULT.step,
                 momentum: str = STALE_DEFAULT.momentum):
        super().__init__(k)
        self.rule = UpdateRule(step, momentum)


class Async(KBatchAsync):
    """Apply every push at once (Hogwild-style ASGD on a server); staleness is recorded.
    `step`, `momentum`: how stale gradients are stepped (staleness.py)."""

    def __init__(self, *, step: str = STALE_DEFAULT.step, momentum: str = STALE_DEFAULT.momentum):
        super().__init__(1, step=step, momentum=momentum)

    def _args(self) -> dict[str, int]:
        return {}


class SSP(Policy):
    """Stale synchronous parallel (Ho et al. 2013): apply at once; a worker that finished c
    iterations starts the next only while c - min(live workers' counts) <= s.
    `step`, `momentum`: how stale gradients are stepped (staleness.py)."""

    rule = STALE_DEFAULT

    def __init__(self, s: int, *, step: str = STALE_DEFAULT.step,
                 momentum: str = STALE_DEFAULT.momentum):
        super().__init__()
        if not isinstance(s, int) or s < 0:
            raise ValueError(f"SSP staleness bound s must be an integer >= 0, got {s!r}")
        self.s = s
        self.rule = UpdateRule(step, momentum)

    def _args(self) -> dict[str, int]:
        return {"s": self.s}

    def _need(self) -> int:
        return 1

    def _may_start(self, worker: int) -> bool:
        slowest = min((self.clock[w] for w in self.live), default=self.clock[worker])
        return self.clock[worker] - slowest <= self.s


def backup_workers(workers: int, backups: int) -> KSync:
    """Synchronous SGD with `backups` backup workers (Chen et al. 2016): KSync(P - b)."""
    if not 0 <= backups < workers:
        raise ValueError(f"backups must be in [0, workers) = [0, {workers}), got {backups}")
    return KSync(workers - backups)
