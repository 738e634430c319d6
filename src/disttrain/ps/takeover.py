"""A dead server's keys served on: the next live copy of each range takes over.

With `replicas >= 2` every key lives on the servers of its chain (chain.py), each copy
holding the values, the optimizer state and the head's version up to the last committed
update (replica.py). When the manager's ring (a heartbeat's answer, manager_link.py)
marks a server d dead, every server computes the same thing: a key of d is now served by
the first live server of its original chain. That server starts a *route* for those
keys, "d@s": a `Server` of their own in its process (its own socket, policy instance,
version = the copy's version of d, optimizer state = the copy's), so workers keep one
link, one version and one round per route and a Sync round sums the same pushes in the
same worker order as d would have: the run stays bitwise equal to an uninterrupted one.
The route reports itself to the manager (`report.adopted`), which puts it in the ring
(`takeovers`), where workers find it (reroute.py).

At most once: a copy knows, per worker, the latest push clock an update it copied
contained and which of its keys were stepped (replicate frames carry [worker, clock]),
so a push the worker sends again (it was never acknowledged) is not applied twice: a
push fully applied is acknowledged at once, one half applied (d died between two
batches of its update) is completed on the keys it lacks, as part of the same round.

Who talks to whom: the server loop calls `Takeover` every iteration (`Server.watch`);
the routes run on their own threads until their workers are done. Docs:
docs/design/parameter-server.md, "Faults and takeover".
"""

from __future__ import annotations

import copy
import sys
import threading
import time

import torch

from disttrain.ps.recopy import Recopy
from disttrain.ps.server import PartialPush, PSError, Server

__all__ = ["Takeover", "first_live"]


def first_live(chain: list[int], dead: set[int]) -> int | None:
    """The server that serves a key of `chain` (head first) once `dead` are gone."""
    return next((s for s in chain if s not in dead), None)


class RouteThreads:
    """Routes served each on a thread of its own, by this server (`self.server`): its
    `routes` (route, thread, row) and the first `failure`, which its loop raises. Shared by
    `Takeover` and join_route.py's `JoinRoutes`."""

    routes: list[tuple[Server, threading.Thread, dict]]
    failure: BaseException | None
    server: Server

    def _serve(self, route: Server, row: dict) -> None:
        try:
            row["stats"] = route.serve()
        except BaseException as e:  # noqa: BLE001 - surfaced on the server loop's thread
            self.failure = e

    def finish(self, wait: float) -> list[dict]:
        """Wait (at most `wait` s) for every route to end; their rows with their stats.
        Raises PSError for a route that failed or did not end."""
        for _, thread, row in self.routes:
            thread.join(wait)
            if thread.is_alive():
                raise PSError(f"server {self.server.index}: the route of server "
                              f"{row['server']}'s keys it took over did not end within "
                              f"{wait:g} s (its workers never said done)")
        if self.failure is not None:
            raise PSError(f"server {self.server.index}: a route it took over failed: "
                          f"{self.failure}")
        return [dict(row) for _, _, row in self.routes]


class Takeover(RouteThreads):
    """Server `server`'s watch on the ring: starts a route for every dead head whose keys
    it is now the first live copy of. Never blocks; raises PSError if a route failed."""

    gone_as = "dead"  # how the report names the server whose keys it serves (move.py: drained)

    def __init__(self, server: Server, beat, plan, init: dict, policy, optimizer, secret: bytes,
                 *, host: str, chunk_bytes: int):
        self.server, self.chain, self.beat, self.plan = server, server.chain, beat, plan
        self.init, self.optimizer, self.secret = init, optimizer, secret
        self.host, self.chunk_bytes = host, chunk_bytes
        self.policy = copy.deepcopy(policy)  # NOTE: before the server steps: a fresh instance
        self.dead: set[int] = set()
        self.left: set[int] = set()  # of them, servers drained (handover.py), not dead
        self.dead_now: frozenset[int] = frozenset()
        self.seen = -1
        self.routes: list[tuple[Server, threading.Thread, dict]] = []
        self.failure: BaseException | None = None
        self.chain.patience = 2.0  # NOTE: the manager's verdict comes first, not a link's timeout
        self.recopy = Recopy(self)
        server.watch = self

    def __call__(self) -> None:
        if self.failure is not None:
            raise PSError(f"server {self.server.index}: a route it took over failed: "
                          f"{self.failure}")
        self.recopy.tick()
        ring = self.beat.ring
        if ring.get("version", -1) <= self.seen:
            return
        self.seen = ring["version"]
        dead = {r["server"] for r in ring["servers"] if r["state"] == "dead"
                and r["server"] < len(self.plan)}  # NOTE: a joiner is join_tails.py's
        left = {r["server"] for r in ring["servers"] if r["state"] == "left"  # NOTE: drained
                and r["server"] < len(self.plan)}  # (handover.py): taken over like a death
        self.left |= left
        for d in sorted((dead | left) - self.dead):
            self.dead.add(d)
            self.dead_now = frozenset(self.dead)  # NOTE: what the routes' threads read
            self._take(d, ring["version"])

    def _take(self, d: int, ring: int) -> None:
        """Server d is dead: stop copying to and from it; serve its keys this server is the
        first live copy of."""
        t0 = time.monotonic()
        self.chain.drop(d)
        index = self.server.index
        for k, ch in self.chain.chains.items():  # NOTE: a copy nothing reaches any more would
            if (k in self.chain.params and d in ch[:ch.index(index)]  # go stale: forget it,
                    and first_live(ch, self.dead) != index):  # so none ever serves it
                del self.chain.params[k]
        keys = [c.key for c in self.plan[d]
                if first_live(self.chain.chains[c.key], self.dead) == index]
        missing = [k for k in keys if k not in self.chain.params]
        if missing:  # NOTE: not a copy here (several deaths): serving it would lose updates
            raise PSError(f"server {index}: server {d} died and this server is the first live "
                          f"one of the chain of {missing[0]!r}, but holds no copy of it")
        route = self._route(d, keys) if keys else None
        self.recopy.start(d, route)  # NOTE: before the route serves: it extends at once
        if route is not None:
            self._start(d, route, ring, t0)
        for head, copied in self.recopy.orphans(d):  # NOTE: a route d hosted, copied here
            self.chain.drop(head)  # NOTE: forgets that route's link, as d's
            self._start(head, self._route(head, copied), ring, t0)

    def _start(self, d: int, route: Server, ring: int, t0: float) -> None:
        """Serve `route` (d's keys) on a thread of its own; report it to the manager."""
        index, n = self.server.index, len(route.params)
        nbytes = sum(p.numel() * p.element_size() for p in route.params.values())
        row = {"server": d, "by": index, "address": route.address, "keys": n,
               "bytes": nbytes, "version": route.policy.version,
               "after": time.monotonic() - t0}
        thread = threading.Thread(target=self._serve, args=(route, row), daemon=True,
                                  name=f"ps-route-{d}@{index}")
        self.routes.append((route, thread, row))
        thread.start()
        self.beat.adopted = [dict(r) for _, _, r in self.routes]  # NOTE: copies: stats come later
        print(f"[ps server{index}] took over {n} keys ({nbytes / 1e6:.2f} MB) of "
              f"{'drained' if d in self.left else self.gone_as} server {d} at version {row['version']} (ring version {ring}); workers reach "
              f"them at {route.address}", file=sys.stderr, flush=True)

    def _route(self, d: int, keys: list[str]) -> Server:
        """A Server for d's `keys` from this server's copies: values, optimizer state,
        version, and what the copies already hold of each worker's latest push."""
        chunks = [c for c in self.plan[d] if c.key in set(keys)]
        route = Server(d, chunks, self.init, copy.deepcopy(self.policy), self.optimizer,
                       self.server.workers, self.secret, host=self.host,
                       timeout=self.server.timeout, chunk_bytes=self.chunk_bytes)
        route.replicas = self.chain.r
        route.grace = route.timeout  # NOTE: workers come once the manager lists it (join_moves.py)
        old = self.chain.optimizer.state if self.chain.optimizer is not None else {}
        with torch.no_grad():
            for k in keys:
                src, dst = self.chain.params[k], route.params[k]
                dst.copy_(src)
                if src in old:  # NOTE: the momentum (or Adam's moments) goes on, bitwise
                    route.optimizer.state[dst] = {n: v.clone() if torch.is_tensor(v) else v
                                                  for n, v in old[src].items()}
        want, version = set(keys), self.chain.version[d]
        halves = {w: (c, ks & want) for w, (c, ks) in self.chain.clocks[d].items()
                  if not want <= ks}
        route.done_clock = {w: c - (w in halves) for w, (c, _) in self.chain.clocks[d].items()}
        route.partial = {w: PartialPush(c, None, dict.fromkeys(ks)) for w, (c, ks) in
                         halves.items() if ks}
        if halves and not route.policy.applies_alone():  # NOTE: that round is done again
            version -= 1  # on the keys it lacks, with the same pushes
        route.policy.version = version
        for w in sorted(self.server.finished):  # NOTE: said done here, so to d as well (or soon)
            route.finished.add(w)
            route.policy.leave(w)  # NOTE: a fresh policy holds nothing: nothing to carry out
        return route
