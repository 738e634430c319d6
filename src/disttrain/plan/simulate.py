"""A discrete-event simulator of a parameter-server job: time per update and staleness.

It drives the servers' own policy objects (ps/policy.py, one per server, as the servers
run them) with the events a real job feeds them, so a mode's semantics live in one place.
Workers follow examples/digits_ps.py's loop and ps/worker.py: pull from every server (the
policy may park the pull), compute (a fixed `base` plus a straggler delay, ps/straggler.py),
push to every server, wait for every ack, pull again; a cancel whose version is newer than
the parameters a worker computes on aborts the computation at once and the worker pulls.
A server handles one message at a time; an update holds it `apply_s` seconds before it
answers (acks, cancels and released pulls leave after the step, as in ps/server.py).

Messages cross links (`Network`): every worker and every server has one full-duplex link;
a message of m bytes holds the sender's uplink and the receiver's downlink for its
transfer time (comm/cost.py's model of one message, without its alpha), first come first
served, and arrives alpha later. Control messages (pull, ack, cancel, an unchanged shard)
cost alpha only. Without a `Network` communication takes no time, the assumption of Dutta
et al. 2018, whose closed forms plan/ps.py checks against. Not simulated: lost and leaving
workers, pushes overlapped with backward. With `Compute.cores` the workers' `base`
compute shares that many cores (plan/cpu.py, processor sharing); without, each worker
computes on its own. A heap of (time, sequence, event) is the loop; the sequence keeps
simultaneous events in the order they were sent. Pure Python: no processes, no torch.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from disttrain.comm.cost import Links, Step
from disttrain.plan.cpu import SharedCores
from disttrain.ps.policy import Policy
from disttrain.ps.straggler import Straggler

__all__ = ["Network", "Compute", "Result", "simulate", "BUDGET"]

_PULL, _PUSH, _PARAMS, _ACK, _CANCEL, _DONE, _CPU = range(7)


@dataclass(frozen=True)
class Network:
    """The links of a job: one per worker and per server, all alike."""

    links: Links = Links()
    """alpha and the link rate (and the CPU pool, if set) of comm/cost.py's model."""
    grad_bytes: float = 0.0
    """Bytes of one whole gradient push (= one whole parameter pull); each server gets 1/S."""

    def __post_init__(self) -> None:
        if not self.grad_bytes >= 0:
            raise ValueError(f"gradient bytes must be >= 0, got {self.grad_bytes}")

    def busy(self, nbytes: float) -> float:
        """Seconds one message of `nbytes` holds its links (comm/cost.py, less alpha)."""
        return self.links.cost(Step(nbytes, remote=True), nodes=1) - self.links.alpha


@dataclass(frozen=True)
class Compute:
    """One worker step: `base` seconds plus the straggler model's delay, seeded."""

    straggler: Straggler = Straggler()
    base: float = 0.0
    """Seconds every step takes besides the delay (forward, backward, the optimizer)."""
    cores: float | None = None
    """Cores the workers' `base` compute shares (plan/cpu.py, processor sharing); None:
    every worker computes on its own core, the compute of one never slows another."""
    background: float = 0.0
    """Other processes always runnable on those cores (`base` was measured beside them)."""
    wake: float = 0.0
    """Seconds a delay overruns: the straggler's sleep ends when its process runs again
    (a wake-up on a loaded machine); added to every delay > 0."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.base) and self.base >= 0):
            raise ValueError(f"base compute must be a finite number >= 0 seconds, got {self.base}")
        if self.cores is not None:
            SharedCores(self.cores, self.background)  # its checks
        if not (math.isfinite(self.wake) and self.wake >= 0):
            raise ValueError(f"wake-up overrun must be a finite number >= 0 seconds, got {self.wake}")


@dataclass
class Result:
    """What one simulation measured on server 0, over the updates after the warm-up."""

    policy: str
    updates: int
    seconds: float
    """Simulated seconds from the end of the warm-up to the last update."""
    staleness: Counter = field(default_factory=Counter)
    """Staleness (versions behind) -> applied gradients, server 0, after the warm-up."""
    stderr: float = 0.0
    """Relative standard error of `time_per_update` (20 batch means)."""
    computations: int = 0
    cancelled: int = 0
    """Computations abandoned (a cancel, or parameters already stale when they arrived)."""
    dropped: int = 0
    """Late pushes server 0's policy threw away (after the warm-up, as the counts above)."""
    warmup: int = 0
    """Updates run first and left out."""

    @property
    def time_per_update(self) -> float:
        return self.seconds / self.updates

    @property
    def updates_per_s(self) -> float:
        return self.updates / self.seconds if self.seconds > 0 else math.inf

    @property
    def mean_staleness(self) -> float:
        n = sum(self.staleness.values())
        return sum(k * v for k, v in self.staleness.items()) / n if n else 0.0


class _Job:
    """The state of one simulated job; `run()` pops events until server 0's target."""

    def __init__(self, make_policy: Callable[[], Policy], workers: int, servers: int,
                 compute: Compute, network: Network | None, apply_s: float, seed: int):
        self.P, self.S = workers, servers
        self.policies = [make_policy() for _ in range(servers)]
        for p in self.policies:
            p.start(list(range(workers)))
        straggler = dataclasses.replace(compute.straggler, seed=seed)
        self.draw = [straggler.sampler(w) for w in range(workers)]
        if compute.wake:
            self.draw = [_overrun(d, compute.wake) for d in self.draw]
        self.base, self.network, self.apply_s = compute.base, network, apply_s
        self.cpu = SharedCores(compute.cores, compute.background) if compute.cores else None
        self.alpha = network.links.alpha if network else 0.0
        self.shard = network.grad_bytes / servers if network else 0.0
        self.shard_busy = network.busy(self.shard) if network and self.shard else 0.0
        self.have = [[-1] * servers for _ in range(workers)]
        self.floor = [[-1] * servers for _ in range(workers)]
        self.waiting = [0] * workers  # replies still due: params while pulling, acks after a push
        self.computing = [False] * workers
        self.attempt = [0] * workers  # NOTE: a compute-done event of an older attempt is void
        self.up = [0.0] * (workers + servers)  # when each node's uplink is free
        self.down = [0.0] * (workers + servers)
        self.server_free = [0.0] * servers
        self.pids = [0] * servers
        self.heap: list = []
        self.seq = 0
        self.times: list[float] = [0.0]  # server 0's update times, index = version
        self.computations = self.cancelled = 0
        self.handlers = (self._server_pull, self._server_push, self._params, self._ack,
                         self._cancel, self._done, self._cpu_done)
        for w in range(workers):
            self._pull(0.0, w)

    # ---- the loop ---------------------------------------------------------------------
    def run(self, target: int) -> None:
        heap, handlers, first = self.heap, self.handlers, self.policies[0]
        while first.version < target:
            if not heap:
                raise RuntimeError(f"{first!r}: the simulated job stopped after "
                                   f"{first.version} updates with nothing left to do")
            t, _, kind, a, b, c = heapq.heappop(heap)
            handlers[kind](t, a, b, c)

    def _at(self, t: float, kind: int, a: int, b: int, c: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b, c))

    def _send(self, t: float, src: int, dst: int, busy: float, kind: int, a, b, c) -> None:
        """A message from node `src` to node `dst` (servers are nodes P..P+S-1)."""
        if busy:
            start = max(t, self.up[src], self.down[dst])
            t = self.up[src] = self.down[dst] = start + busy
        self._at(t + self.alpha, kind, a, b, c)

    # ---- workers ----------------------------------------------------------------------
    def _pull(self, t: float, w: int) -> None:
        self.waiting[w] = self.S
        for s in range(self.S):
            self._send(t, w, self.P + s, 0.0, _PULL, s, w, 0)

    def _params(self, t: float, w: int, s: int, version: int) -> None:
        self.have[w][s] = version
        self.waiting[w] -= 1
        if self.waiting[w]:
            return
        if any(h < f for h, f in zip(self.have[w], self.floor[w])):
            self.cancelled += 1  # NOTE: a cancel overtook these parameters: pull again
            self._pull(t, w)
            return
        self.computing[w] = True
        self.attempt[w] += 1
        self.computations += 1
        if self.cpu is None:
            self._at(t + self.base + self.draw[w](), _DONE, w, self.attempt[w], 0)
            return
        self.cpu.add(t, w, self.base)  # NOTE: the CPU part first, then the delay (a sleep)
        self._cpu_next()

    def _cpu_next(self) -> None:
        end = self.cpu.next_done()
        if end is not None:
            self._at(end, _CPU, self.cpu.token, 0, 0)

    def _cpu_done(self, t: float, token: int, _: int, __: int) -> None:
        if token != self.cpu.token:
            return  # the set of tasks changed since: a newer event stands
        for w in self.cpu.finish(t):
            self._at(t + self.draw[w](), _DONE, w, self.attempt[w], 0)
        self._cpu_next()

    def _cancel(self, t: float, w: int, s: int, version: int) -> None:
        self.floor[w][s] = max(self.floor[w][s], version)
        if self.computing[w] and self.have[w][s] < version:
            self.computing[w] = False
            self.attempt[w] += 1
            self.cancelled += 1
            if self.cpu is not None and w in self.cpu.work:
                self.cpu.remove(t, w)
                self._cpu_next()
            self._pull(t, w)

    def _done(self, t: float, w: int, attempt: int, _: int) -> None:
        if attempt != self.attempt[w]:
            return
        self.computing[w] = False
        self.waiting[w] = self.S
        for s in range(self.S):
            self._send(t, w, self.P + s, self.shard_busy, _PUSH, s, w, self.have[w][s])

    def _ack(self, t: float, w: int, _: int, __: int) -> None:
        self.waiting[w] -= 1
        if not self.waiting[w]:
            self._pull(t, w)

    # ---- servers ----------------------------------------------------------------------
    def _server_pull(self, t: float, s: int, w: int, _: int) -> None:
        if t < self.server_free[s]:  # NOTE: one message at a time, in arrival order
            self._at(self.server_free[s], _PULL, s, w, 0)
            return
        self._execute(t, s, self.policies[s].pull(w))

    def _server_push(self, t: float, s: int, w: int, version: int) -> None:
        if t < self.server_free[s]:
            self._at(self.server_free[s], _PUSH, s, w, version)
            return
        pid = self.pids[s]
        self.pids[s] += 1
        out = self._execute(t, s, self.policies[s].push(pid, w, version))
        self._send(out, self.P + s, w, 0.0, _ACK, w, s, 0)

    def _execute(self, t: float, s: int, d) -> float:
        """Carry out a decision as ps/server.py does; returns when the server answers."""
        if d.error:
            raise RuntimeError(f"server {s}: {d.error}")
        policy = self.policies[s]
        if d.apply:
            t = self.server_free[s] = t + self.apply_s
            if s == 0:
                self.times.append(t)
        for w in d.cancel:
            self._send(t, self.P + s, w, 0.0, _CANCEL, w, s, policy.version)
        for w in d.release:  # NOTE: an unchanged shard is one empty message
            busy = 0.0 if self.have[w][s] == policy.version else self.shard_busy
            self._send(t, self.P + s, w, busy, _PARAMS, w, s, policy.version)
        return t


def _overrun(draw: Callable[[], float], wake: float) -> Callable[[], float]:
    """A delay sampler whose every sleep (delay > 0) lasts `wake` seconds longer."""
    def drawn() -> float:
        d = draw()
        return d + wake if d > 0 else d
    return drawn


BUDGET = 40_000
"""Worker computations a simulation runs by default (about 0.4 s of CPU here)."""


def simulate(make_policy: Callable[[], Policy], workers: int, compute: Compute, *,
             servers: int = 1, network: Network | None = None, apply_s: float = 0.0,
             updates: int | None = None, warmup: int | None = None, seed: int = 0) -> Result:
    """Simulate a job until server 0 applied `warmup + updates` updates (blocks, pure CPU).

    `make_policy()` builds one fresh policy per server. `warmup` (default updates // 10)
    updates are run first and left out of the time and the staleness histogram. Without
    `updates`, 1,000 updates of warm-up, then as many as take about `BUDGET` worker
    computations at the warm-up's rate (2,000 to 100,000 updates).
    """
    if workers < 1 or servers < 1:
        raise ValueError(f"a job needs >= 1 worker and >= 1 server, got {workers} and {servers}")
    if updates is not None and updates < 20:
        raise ValueError(f"simulate at least 20 updates (for the error estimate), got {updates}")
    if not (math.isfinite(apply_s) and apply_s >= 0):
        raise ValueError(f"apply time must be a finite number >= 0 seconds, got {apply_s}")
    if warmup is None:
        warmup = 1_000 if updates is None else updates // 10
    job = _Job(make_policy, workers, servers, compute, network, apply_s, seed)
    job.run(warmup)
    if updates is None:
        per_update = job.computations / max(warmup, 1)
        updates = int(min(max(BUDGET / max(per_update, 1e-9), 2_000), 100_000))
    first = job.policies[0]
    staleness, dropped = Counter(first.staleness), first.dropped
    computations, cancelled = job.computations, job.cancelled
    job.run(warmup + updates)
    times = job.times[warmup:warmup + updates + 1]
    return Result(repr(first), updates, times[-1] - times[0], first.staleness - staleness,
                  _batch_stderr(times), job.computations - computations,
                  job.cancelled - cancelled, first.dropped - dropped, warmup)


def _batch_stderr(times: list[float], batches: int = 20) -> float:
    """Relative standard error of the mean interval, from `batches` batch means."""
    n = (len(times) - 1) // batches
    means = [(times[(i + 1) * n] - times[i * n]) / n for i in range(batches)]
    mean = sum(means) / batches
    if mean <= 0:
        return 0.0
    var = sum((m - mean) ** 2 for m in means) / (batches - 1)
    return math.sqrt(var / batches) / mean
