"""Where each copy of a key lives with `replicas=r`: the chains, and a server's place in them.

A key's chain is the placement's `chain(key, r)` (placement.py): its owner (the head)
then the next r-1 distinct servers of the ring, the last one the tail (chain replication, van Renesse &
Schneider 2004; the PS paper's replication of key ranges on the ring, Li et al. 2014
sec. 4.3). Pure: no sockets, no tensors. replica.py moves the updates along them.
"""

from __future__ import annotations

from collections import defaultdict

from disttrain.ps.placement import Plan

__all__ = ["chains", "check_replicas", "Layout", "role", "ROLES"]

ROLES = ("head", "middle", "tail")


def check_replicas(replicas: int, servers: int, snapshot: str | None = None) -> None:
    """Raise ValueError, naming the fix, for a replication this job cannot do."""
    if not isinstance(replicas, int) or isinstance(replicas, bool) or not 1 <= replicas:
        raise ValueError(f"replicas={replicas!r} must be an integer >= 1 (1: no copies)")
    if replicas > servers:
        raise ValueError(f"replicas={replicas} needs at least {replicas} servers, the job has "
                         f"{servers}: launch with --servers {replicas} or pass replicas <= "
                         f"{servers}")
    if replicas > 1 and snapshot:
        raise ValueError(f"replicas={replicas} with snapshot={snapshot!r}: a restored head "
                         "would differ from its replicas; use one or the other")


def role(chain, index: int) -> str:
    """"head", "middle" or "tail": what server `index` is in `chain`."""
    return ROLES[0 if chain[0] == index else 2 if chain[-1] == index else 1]


def chains(plan: Plan, replicas: int) -> dict[str, list[int]]:
    """key -> the server indices holding it, head first (the plan's `chain(key, r)`);
    raises if a chain's head is not the key's owner in `plan`."""
    out = {}
    for owner, chunks in enumerate(plan):
        for c in chunks:
            out[c.key] = plan.indices(c.key, replicas)
            if out[c.key][0] != owner:
                raise RuntimeError(f"key {c.key!r}: the plan puts it on server {owner}, the "
                                   f"ring's chain starts at server {out[c.key][0]}")
    return out




class Layout:
    """Server `index`'s place in every chain of a plan (each server's Chunks)."""

    def __init__(self, index: int, plan: Plan, replicas: int):
        self.chains = chains(plan, replicas)
        self.hop: dict[str, int | None] = {}
        """key held here (head or copy) -> the next server of its chain (None: the tail)."""
        self.origin_hops: dict[int, set[int]] = defaultdict(set)
        """head -> the next servers of the chains of its keys that pass here."""
        self.paths: dict[tuple, set[int]] = defaultdict(set)
        """(head, previous server or None here at the head) -> next servers: the way a
        marker without keys goes on, along the chains it came on."""
        self.copies: dict[int, list] = defaultdict(list)
        """previous server -> the Chunks of the copies held here that it sends."""
        self.ranges: dict[tuple, list] = defaultdict(list)
        """chain (tuple) -> its Chunks: this server's key ranges and its role in each."""
        for c in (c for chunks in plan for c in chunks):
            chain = self.chains[c.key]
            if index not in chain:
                continue
            at = chain.index(index)
            self.ranges[tuple(chain)].append(c)
            self.hop[c.key] = chain[at + 1] if at + 1 < len(chain) else None
            if self.hop[c.key] is not None:  # NOTE: markers follow the chains they came on
                self.origin_hops[chain[0]].add(self.hop[c.key])
                self.paths[(chain[0], chain[at - 1] if at else None)].add(self.hop[c.key])
            if at > 0:
                self.copies[chain[at - 1]].append(c)
        self.feeds = {(self.chains[c.key][0], j) for j, cs in self.copies.items() for c in cs}
        """(head, previous server) of every chain whose copy is here: each must say final."""
