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

After a join with replicas=2 (join_head.py) a moved key's chain is [S+1+X, c1]: the
joiner's route of old owner X at its head. When the ring marks the joiner dead, c1
serves those keys as a route of X from its copy (version and push clocks kept under the
route's id), read from the chains it holds, not the launch plan. No copy is made again
after a join (recopy.py follows the launch plan): the route says it has fewer copies.

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
        self.joiner_dead = False  # the ring marks the joiner (index len(plan)) dead
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
        if self.joiner_dead:  # NOTE: every turn: a copy relinks when the handed marker comes
            self._joiner_routes(ring.get("version", 0))
        if ring.get("version", -1) <= self.seen:
            return
        self.seen = ring["version"]
        self.joiner_dead = any(r["server"] == len(self.plan) and r["state"] == "dead"
                               for r in ring["servers"])
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
        keys = [c.key for c in self.plan[d] if self.chain.chains[c.key][0] == d  # NOTE: not
                and first_live(self.chain.chains[c.key], self.dead) == index]  # a join's moved
        missing = [k for k in keys if k not in self.chain.params]
        if missing:  # NOTE: not a copy here (several deaths): serving it would lose updates
            raise PSError(f"server {index}: server {d} died and this server is the first live "
                          f"one of the chain of {missing[0]!r}, but holds no copy of it")
        route = self._route(d, keys) if keys else None
        joined = self.joined(self.beat.ring)
        if not joined:
            self.recopy.start(d, route)  # NOTE: before the route serves: it extends at once
        if route is not None:
            self._start(d, route, ring, t0)
            if joined:
                self._alone()
        for head, copied in self.recopy.orphans(d):  # NOTE: a route d hosted, copied here
            self.chain.drop(head)  # NOTE: forgets that route's link, as d's
            self._start(head, self._route(head, copied), ring, t0)

    def joined(self, ring: dict) -> bool:
        """A join moved keys (the ring lists a joiner's route, or a handed marker passed
        here: join_head.py): chains are no longer the launch plan's, which recopy.py's
        moves follow, so no copy is made again after a death (fewer copies, stated in the
        output)."""
        n = len(self.plan)
        return (any(t["by"] >= n for t in ring.get("takeovers", ()))
                or any(getattr(self.chain, "handed", {}).values())
                or any(ch[0] > n for ch in self.chain.chains.values()))

    def _joiner_routes(self, ring: int) -> None:
        """The joiner Y (index S = len(plan)) is dead: serve the keys of each of its routes
        (head S+1+X of [S+1+X, c1, ..., T], join_head.relink) whose first live copy is
        this server, as a route of X, from this copy (version and push clocks kept under
        the route's origin). Raises PSError for a chain with a copy after this one
        (replicas >= 3: not relinked)."""
        n, index = len(self.plan), self.server.index
        heads: dict[int, list[str]] = {}
        for k, ch in self.chain.chains.items():
            if (ch[0] > n and ch[0] not in self.dead and k in self.chain.params
                    and first_live(ch, self.dead | {ch[0]}) == index):
                heads.setdefault(ch[0], []).append(k)
        for h, keys in sorted(heads.items()):
            t0, x, ch = time.monotonic(), h - n - 1, self.chain.chains[keys[0]]
            if ch[-1] != index:
                raise PSError(f"server {index}: joining server {n} died after it served "
                              f"server {x}'s moved keys; this server, their first live copy, "
                              f"would serve them, but their chain {ch} holds copies after it, "
                              "which a takeover after a join does not relink (built for "
                              "replicas=2): the job stops; restart it")
            self.dead.add(h)
            self.dead_now = frozenset(self.dead)
            self.chain.drop(h)  # NOTE: nothing more comes from (or is awaited of) the route
            route = self._route(x, keys, origin=h)
            for k in keys:  # NOTE: nothing feeds this copy any more: the route's values go on
                del self.chain.params[k]
            self._start(x, route, ring, t0, f"server {x} from the route of dead joining "
                        f"server {n}")
            self._alone()

    def _alone(self) -> None:
        """Say that the route just started has fewer copies (none made again after a join)."""
        print(f"[ps server{self.server.index}] serves them with fewer copies (replicas="
              f"{self.chain.r} is not restored after a join: not built); if this server dies "
              "too, the job stops", file=sys.stderr, flush=True)

    def _start(self, d: int, route: Server, ring: int, t0: float,
               whose: str | None = None) -> None:
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
        whose = whose or f"{'drained' if d in self.left else self.gone_as} server {d}"
        print(f"[ps server{index}] took over {n} keys ({nbytes / 1e6:.2f} MB) of {whose} at "
              f"version {row['version']} (ring version {ring}); workers reach them at "
              f"{route.address}", file=sys.stderr, flush=True)

    def _route(self, d: int, keys: list[str], origin: int | None = None) -> Server:
        """A Server for d's `keys` from this server's copies: values, optimizer state,
        version, and what the copies already hold of each worker's latest push (kept under
        `origin`, default d: a joiner's route's party id for the keys it headed)."""
        origin = d if origin is None else origin
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
        want, version, clocks = set(keys), self.chain.version[origin], self.chain.clocks[origin]
        halves = {w: (c, ks & want) for w, (c, ks) in clocks.items() if not want <= ks}
        route.done_clock = {w: c - (w in halves) for w, (c, _) in clocks.items()}
        route.partial = {w: PartialPush(c, None, dict.fromkeys(ks)) for w, (c, ks) in
                         halves.items() if ks}
        if halves and not route.policy.applies_alone():  # NOTE: that round is done again
            version -= 1  # on the keys it lacks, with the same pushes
        route.policy.version = version
        for w in sorted(self.server.finished):  # NOTE: said done here, so to d as well (or soon)
            route.finished.add(w)
            route.policy.leave(w)  # NOTE: a fresh policy holds nothing: nothing to carry out
        return route
