"""The cost model of the allreduce algorithms (alpha-beta plus a CPU term), and `auto`'s choice.

A message of m bytes costs alpha + m / B on a link of B bytes/s (Hockney 1994; the
form used by Thakur, Rabenseifner & Gropp 2005 and by NCCL's tuner). The cluster is
M nodes of L ranks each (node-major ranks, N = M L); every node has one link of
`link_Bps` that its L ranks share. Each algorithm is a list of steps (`steps`); a step
costs its latency (alpha, plus `step_alpha` per sender) and then its slowest link or the
CPU pool that moves the step's bytes (`cpu_Bps`), whichever is slower. The pool is a
node's cores, or all nodes' when they share one machine, as emulated clusters do.
Without the CPU terms (the defaults) it is the plain alpha-beta model. Formulas, the
fit and a worked 4 x 2 example: docs/cluster.md ("Notes from comm/cost.py").

`collective_steps` / `predict_collective` price the other collectives with the same
steps (reduce-scatter and all-gather are the ring's halves, p2p one message);
`collective_bound` says which part (latency, link bandwidth, CPU pool) dominates one.

Who talks to whom: comm/algorithms.py's `auto`, benchmarks/allreduce.py,
benchmarks/scaling.py and plan/cost.py (`disttrain plan layout`) ask it for predictions. Pure functions: no processes, no torch.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping
from dataclasses import dataclass

from disttrain import settings

__all__ = ["Links", "Step", "steps", "predict", "choose_algorithm", "links_from_env", "MODELLED",
           "COLLECTIVES", "collective_steps", "predict_collective", "collective_bound"]

MODELLED = ("ring", "halving-doubling", "tree", "hierarchical")
COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "p2p")
"""What `predict_collective` models (the collectives `disttrain plan layout` prices)."""


@dataclass(frozen=True)
class Step:
    """One step of an algorithm: each of its senders sends one message of `nbytes`."""

    nbytes: float
    remote: bool
    """Whether the step's slowest message crosses a node link."""
    sharing: int = 1
    """Ranks of one node whose messages cross that node's link at once."""
    remote_senders: int = 1
    """Senders (all nodes) whose message crosses a node link."""
    local_senders: int = 0
    """Senders whose message stays inside its node."""


@dataclass(frozen=True)
class Links:
    """What the model knows about a cluster."""

    alpha: float = 100e-6
    """Seconds per message across nodes (fitted by benchmarks/allreduce.py)."""
    link_Bps: float = 10e9 / 8
    """Bytes/s of one node's link (its `--link` rate)."""
    local_alpha: float = 50e-6
    """Seconds per message between two ranks of one node."""
    local_Bps: float = 2e9
    """Bytes/s between two ranks of one node (loopback, bounded by CPU)."""
    step_alpha: float = 0.0
    """CPU pool seconds per sender per step (waking it, posting its messages)."""
    cpu_Bps: float = math.inf
    """Bytes/s of messages across nodes the CPU pool moves for all its senders together."""
    cpu_local_Bps: float = math.inf
    """The same for messages inside a node (no bridge, no shaping: cheaper)."""
    shared_cpu: bool = False
    """True when all nodes share one CPU pool (emulated clusters); else one pool per node."""

    def cost(self, s: Step, nodes: int) -> float:
        """Seconds of one step: latency, then the link or the CPU pool, whichever is slower."""
        share = 1 if self.shared_cpu else 1 / max(nodes, 1)
        senders = (s.remote_senders + s.local_senders) * share
        cpu = share * s.nbytes * (s.remote_senders / self.cpu_Bps + s.local_senders / self.cpu_local_Bps)
        if s.remote:
            return self.alpha + self.step_alpha * senders + max(s.sharing * s.nbytes / self.link_Bps, cpu)
        return self.local_alpha + self.step_alpha * senders + max(s.nbytes / self.local_Bps, cpu)

    def parts(self, s: Step, nodes: int) -> dict[str, float]:
        """`cost`'s three parts: "latency" (alpha and the per-sender CPU time), "bandwidth"
        (the link), "cpu" (the pool moving the bytes); the step costs latency + the larger
        of the other two."""
        share = 1 if self.shared_cpu else 1 / max(nodes, 1)
        senders = (s.remote_senders + s.local_senders) * share
        cpu = share * s.nbytes * (s.remote_senders / self.cpu_Bps + s.local_senders / self.cpu_local_Bps)
        alpha, wire = ((self.alpha, s.sharing * s.nbytes / self.link_Bps) if s.remote
                       else (self.local_alpha, s.nbytes / self.local_Bps))
        return {"latency": alpha + self.step_alpha * senders, "bandwidth": wire, "cpu": cpu}


def steps(algorithm: str, nbytes: float, world: int, local: int) -> list[Step]:
    """The steps of one allreduce of `nbytes` over `world` ranks, `local` per node."""
    if world == 1:
        return []
    nodes = world // local
    if algorithm in ("ring", "native"):  # NOTE: node-major: one hop per node crosses its link
        cross = nodes if nodes > 1 else 0
        return [Step(nbytes / world, nodes > 1, 1, cross, world - cross)] * (2 * (world - 1))
    if algorithm == "hierarchical":
        inside = [Step(nbytes / local, False, 1, 0, world)] * (2 * (local - 1))
        return inside + [Step(nbytes / world, True, local, world, 0)] * (2 * (nodes - 1))
    if algorithm == "halving-doubling":
        return _halving_doubling(nbytes, world, local)
    if algorithm == "tree":
        out = []
        for k in range(math.ceil(math.log2(world))):
            pairs = len(range(1 << k, world, 2 << k))  # ranks r with r % 2^(k+1) == 2^k send
            remote = (1 << k) >= local
            out.append(Step(nbytes, remote, 1, pairs if remote else 0, 0 if remote else pairs))
        return out + out[::-1]
    raise ValueError(f"no model for algorithm {algorithm!r}; modelled: {', '.join(MODELLED)}")


def _halving_doubling(nbytes: float, world: int, local: int) -> list[Step]:
    p = 1 << (world.bit_length() - 1)
    extra, far = world - p, local == 1
    fold = [Step(nbytes, far, 1, extra if far else 0, 0 if far else extra)] if extra else []
    half, size, dist = [], nbytes, p // 2
    while dist:
        size /= 2
        remote = dist >= local
        half.append(Step(size, remote, local if remote else 1, p if remote else 0, 0 if remote else p))
        dist //= 2
    return fold + half + half[::-1] + fold


def predict(algorithm: str, nbytes: float, world: int, local: int, links: Links) -> float:
    """Predicted seconds of one allreduce of `nbytes` over `world` ranks, `local` per node."""
    return sum(links.cost(s, world // local) for s in steps(algorithm, nbytes, world, local))


def collective_steps(op: str, nbytes: float, world: int, local: int) -> list[Step]:
    """The ring steps of one collective over `world` ranks, `local` per node (node-major).

    `nbytes` is the full tensor: the all-reduce's input, the reduce-scatter's input (each
    rank keeps nbytes / world), the all-gather's output. A ring all-reduce is a
    reduce-scatter (its first world - 1 steps) then an all-gather (the last world - 1),
    as NCCL and `steps("ring", ...)` run it; "p2p" is one message of `nbytes` to the next
    node when `local` < `world`, else inside the node.
    """
    if op not in COLLECTIVES:
        raise ValueError(f"no model for collective {op!r}; modelled: {', '.join(COLLECTIVES)}")
    if op == "p2p":
        remote = local < world
        return [Step(nbytes, remote, 1, 1 if remote else 0, 0 if remote else 1)]
    ring = steps("ring", nbytes, world, local)
    if op == "all-reduce":
        return ring
    return ring[: len(ring) // 2]  # NOTE: both halves cost the same; either stands for the op


def predict_collective(op: str, nbytes: float, world: int, local: int, links: Links) -> float:
    """Predicted seconds of one ring `op` (see `collective_steps`) of `nbytes`."""
    return sum(links.cost(s, max(world // local, 1))
               for s in collective_steps(op, nbytes, world, local))


def collective_bound(op: str, nbytes: float, world: int, local: int, links: Links,
                     algorithm: str = "ring") -> tuple[str, float, dict[str, float]]:
    """What bounds one `op` in this model: ("latency" | "bandwidth" | "cpu", predicted
    seconds, seconds per part). Per step only the slower of link and CPU pool counts. An
    all-reduce runs `algorithm`'s steps (`steps`); the other collectives the ring's."""
    total = {"latency": 0.0, "bandwidth": 0.0, "cpu": 0.0}
    nodes = max(world // local, 1)
    plan = (steps(algorithm, nbytes, world, local) if op == "all-reduce"
            else collective_steps(op, nbytes, world, local))
    objects = dict(zip(map(id, plan), plan))  # NOTE: a ring repeats one Step object 2(n-1)
    for key, n in collections.Counter(map(id, plan)).items():  # times: price it once
        p = links.parts(objects[key], nodes)
        total["latency"] += n * p["latency"]
        slower = "cpu" if p["cpu"] > p["bandwidth"] else "bandwidth"
        total[slower] += n * p[slower]
    return max(total, key=total.get), sum(total.values()), total


def links_from_env(environ: Mapping[str, str] | None = None) -> Links:
    """The cluster's links as `disttrain run --cluster` exports them (defaults otherwise).

    DISTTRAIN_LINK_GBPS (Gbit/s), DISTTRAIN_ALPHA_US (microseconds); the local ones
    DISTTRAIN_LOCAL_GBPS and DISTTRAIN_LOCAL_ALPHA_US; the CPU pool's
    DISTTRAIN_STEP_US, DISTTRAIN_CPU_GBPS, DISTTRAIN_CPU_LOCAL_GBPS and DISTTRAIN_SHARED_CPU
    (1: one pool for all nodes). Without `environ`, this process's `settings.current()`.
    """
    s = settings.current() if environ is None else settings.Settings.from_env(environ)
    d = Links()
    return Links(
        alpha=(d.alpha * 1e6 if s.alpha_us is None else s.alpha_us) * 1e-6,
        link_Bps=(d.link_Bps * 8e-9 if s.link_gbps is None else s.link_gbps) * 1e9 / 8,
        local_alpha=(d.local_alpha * 1e6 if s.local_alpha_us is None else s.local_alpha_us) * 1e-6,
        local_Bps=(d.local_Bps * 8e-9 if s.local_gbps is None else s.local_gbps) * 1e9 / 8,
        step_alpha=s.step_us * 1e-6,
        cpu_Bps=s.cpu_gbps * 1e9 / 8,
        cpu_local_Bps=s.cpu_local_gbps * 1e9 / 8,
        shared_cpu=s.shared_cpu,
    )


def choose_algorithm(nbytes: float, world: int, local: int, links: Links | None = None) -> str:
    """The modelled algorithm with the lowest predicted time (ties: the first in MODELLED)."""
    links = links or links_from_env()
    candidates = [a for a in MODELLED if a != "hierarchical" or 1 < local < world]
    return min(candidates, key=lambda a: predict(a, nbytes, world, local, links))
