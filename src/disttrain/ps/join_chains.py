"""Where the copies of each key live when a server joins a job with `replicas=r`: pure.

The scheme (docs/design/parameter-server.md, "A server joins", "With replicas >= 2"):
the joiner Y takes the same keys as with r = 1 (`joined_owners`: the bounded-load
placement on the S old servers and Y, keys that placement moves between two old servers
stay). A moved key of X with chain [X, c1, ..., c(r-1)] is extended at its tail to Y
(chain extension: [X, c1, ..., c(r-1), Y], r + 1 copies while it moves), X then hands
its head over at a clean point, and its chain becomes [Y, c1, ..., c(r-1)]: Y replaces X
at the head, the copies stay where they are, every other chain is unchanged. So exactly
the r = 1 join's bytes travel (once, to Y), no range ever has fewer than r copies, and
with r = 1 this is the r = 1 join (the tail is X, the chain after is [Y]).

Every party computes the same moves from the model, the servers launched and the joiner's
index, so the manager sends no key lists. Pure: no sockets, no tensors.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

from disttrain.ps.join_moves import joined_owners
from disttrain.ps.placement import Plan

__all__ = ["JoinMove", "join_moves", "extensions", "chains_after"]


class JoinMove(NamedTuple):
    """One key that moves to the joiner, and its chain before and after."""

    key: str
    before: tuple[int, ...]
    """its chain before the join, head (the old owner X) first."""
    after: tuple[int, ...]
    """its chain once the joiner serves it: the joiner, then before[1:]."""
    tail: int
    """the server that extends the chain to the joiner: before[-1] (X with r = 1)."""


def join_moves(params: list[tuple[str, int, int]], plan: Plan, new: int, replicas: int,
               chunk_bytes: int) -> list[JoinMove]:
    """The keys of a job launched with `len(plan)` servers that move to joining server
    `new`, with their chains (`replicas` copies each), in plan order. Pure; the same on
    every rank. Raises ValueError naming the fix for a replicas the job cannot have."""
    servers = len(plan)
    if not 1 <= replicas <= servers:
        raise ValueError(f"replicas={replicas} with {servers} servers launched: a chain "
                         f"holds 1 to {servers} copies")
    if new < servers:
        raise ValueError(f"server {new} is one of the {servers} servers launched: a joiner "
                         f"takes the next free index, e.g. {servers}")
    out = []
    for x in range(servers):
        keys = [c.key for c in plan[x]]
        if not keys:
            continue
        for k, o in joined_owners(params, servers, new, x, keys, chunk_bytes).items():
            if o == new:
                before = tuple(plan.indices(k, replicas))
                out.append(JoinMove(k, before, (new, *before[1:]), before[-1]))
    return out


def extensions(moves: list[JoinMove]) -> dict[tuple[int, int], list[str]]:
    """(old owner, tail) -> the keys that tail extends to the joiner, in plan order: one
    `transfer.extend` on the tail and one `transfer.accept` on the joiner each (an
    extension carries one head's keys)."""
    out: dict[tuple[int, int], list[str]] = defaultdict(list)
    for m in moves:
        out[(m.before[0], m.tail)].append(m.key)
    return dict(out)


def chains_after(plan: Plan, replicas: int, moves: list[JoinMove]) -> dict[str, list[int]]:
    """Every key's chain once the join is done: a moved key's `after`, every other key's
    chain as before. What `disttrain ps status` shows and a later takeover reads."""
    out = {c.key: plan.indices(c.key, replicas) for chunks in plan for c in chunks}
    out.update({m.key: list(m.after) for m in moves})
    return out
