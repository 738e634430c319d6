"""The alpha-beta (Hockney) cost model of the allreduce algorithms, and `auto`'s choice.

A message of m bytes costs alpha + m / B on a link of B bytes/s (Hockney 1994; the
form used by Thakur, Rabenseifner & Gropp 2005 and by NCCL's tuner). The cluster is
M nodes of L ranks each (node-major ranks, N = M L); every node has one link of
`link_Bps` that its L ranks share, and ranks on one node talk at `local_Bps` with
latency `local_alpha`. Pure functions: no processes, no torch.

Predictions for S bytes (each step costs the slowest transfer of that step):
  ring               2(N-1) steps, S/N per step; with M > 1 one chunk per step
                     crosses every node link: 2(N-1) alpha + 2(N-1)/N S/B
  hierarchical       2(L-1) local steps of S/L, then 2(M-1) steps in which the L rings
                     of a node together move S/M over its link: + 2(M-1)/M S/B
  halving-doubling   2 log2 P steps (P = largest power of two <= N; 2 more to fold the
                     rest), step k moves S/2^k; a step whose partners are d >= L ranks
                     apart puts all L ranks of a node on its link at once
  tree               2 ceil(log2 N) steps of the whole S; one sender per node per step
Example, 4 nodes x 2 ranks (N = 8): ring 14 alpha + 1.75 S/B; hierarchical
6 alpha + 1.5 S/B + 2 local steps of S/2.
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
