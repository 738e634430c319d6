"""The alpha-beta (Hockney) cost model of the allreduce algorithms, and `auto`'s choice.

A message of m bytes costs alpha + m / B on a link of B bytes/s (Hockney 1994; the
form used by Thakur, Rabenseifner & Gropp 2005 and by NCCL's tuner). The cluster is
M nodes of L ranks each (node-major ranks, N = M L); every node has one link of
`link_Bps` that its L ranks share, and ranks on one node talk at `local_Bps` with
latency `local_alpha`. Each step of an algorithm costs the slowest transfer of that
step; the per-algorithm formulas (ring, hierarchical, halving-doubling, tree) and a
worked 4 x 2 example: docs/cluster.md ("Notes from cluster/model.py").

Who talks to whom: comm/algorithms.py's `auto` and benchmarks/allreduce.py ask it for
predictions. Pure functions: no processes, no torch.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

__all__ = ["Links", "predict", "choose_algorithm", "links_from_env", "MODELLED"]

MODELLED = ("ring", "halving-doubling", "tree", "hierarchical")


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

    def step(self, nbytes: float, remote: bool, sharing: int = 1) -> float:
        """One step: `sharing` ranks of a node send `nbytes` each over the same link."""
        if remote:
            return self.alpha + sharing * nbytes / self.link_Bps
        return self.local_alpha + nbytes / self.local_Bps


def predict(algorithm: str, nbytes: float, world: int, local: int, links: Links) -> float:
    """Predicted seconds of one allreduce of `nbytes` over `world` ranks, `local` per node."""
    if world == 1:
        return 0.0
    nodes = world // local
    if algorithm in ("ring", "native"):
        return 2 * (world - 1) * links.step(nbytes / world, remote=nodes > 1)
    if algorithm == "hierarchical":
        inside = 2 * (local - 1) * links.step(nbytes / local, remote=False)
        return inside + 2 * (nodes - 1) * links.step(nbytes / world, remote=True, sharing=local)
    if algorithm == "halving-doubling":
        return _halving_doubling(nbytes, world, local, links)
    if algorithm == "tree":
        levels = math.ceil(math.log2(world))
        remote = sum(1 for k in range(levels) if (1 << k) >= local)
        return 2 * (remote * links.step(nbytes, True) + (levels - remote) * links.step(nbytes, False))
    raise ValueError(f"no model for algorithm {algorithm!r}; modelled: {', '.join(MODELLED)}")


def _halving_doubling(nbytes: float, world: int, local: int, links: Links) -> float:
    p = 1 << (world.bit_length() - 1)
    total = 0.0
    if p != world:  # fold in and out: one whole-message step each way, across a node pair
        total += 2 * links.step(nbytes, remote=local == 1)
    size, dist = nbytes, p // 2
    while dist:
        size /= 2
        remote = dist >= local
        total += 2 * links.step(size, remote, sharing=local if remote else 1)
        dist //= 2
    return total


def links_from_env(environ=os.environ) -> Links:
    """The cluster's links as `disttrain run --cluster` exports them (defaults otherwise).

    DISTTRAIN_LINK_GBPS (Gbit/s), DISTTRAIN_ALPHA_US (microseconds); the local ones
    DISTTRAIN_LOCAL_GBPS and DISTTRAIN_LOCAL_ALPHA_US.
    """
    d = Links()
    return Links(
        alpha=float(environ.get("DISTTRAIN_ALPHA_US", d.alpha * 1e6)) * 1e-6,
        link_Bps=float(environ.get("DISTTRAIN_LINK_GBPS", d.link_Bps * 8e-9)) * 1e9 / 8,
        local_alpha=float(environ.get("DISTTRAIN_LOCAL_ALPHA_US", d.local_alpha * 1e6)) * 1e-6,
        local_Bps=float(environ.get("DISTTRAIN_LOCAL_GBPS", d.local_Bps * 8e-9)) * 1e9 / 8,
    )


def choose_algorithm(nbytes: float, world: int, local: int, links: Links | None = None) -> str:
    """The modelled algorithm with the lowest predicted time (ties: the first in MODELLED)."""
    links = links or links_from_env()
    candidates = [a for a in MODELLED if a != "hierarchical" or 1 < local < world]
    return min(candidates, key=lambda a: predict(a, nbytes, world, local, links))
