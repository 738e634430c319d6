"""A server joins a job with `replicas >= 2`: the joiner heads the moved ranges.

Step 4 of the join with replicas (docs/design/parameter-server.md, "A server joins", "With
`replicas >= 2`"), the joiner Y's side. Once old owner X's `handed` marker reached Y (the
last copy of X's moved keys: join_head.py), Y holds exactly X's state of them, and every
other copy has already relinked them to the chain [route, c1, ..., T]. Y then serves them
as a route "X@Y": a `Server` of their own in Y's process (takeover.py's route: its own
socket, policy instance, X's version, the copy's values, optimizer state and per-worker
push clocks), answering workers as server X (their hello names X and the moved keys) and
heading the chain under a party id of its own, `route_id` (S + 1 + X): its link to c1 is
W + S + 1 + X and its `replicate` frames' origin S + 1 + X, so a route of X and X itself
(which heads its kept keys on) never feed one copy under one name. Y then forgets its own
copy of the keys (the route's chain has r copies: the route and c1..T).

Who talks to whom: `JoinRoutes` is Y's watch (`Server.watch`, the joiner's loop): it
reports each installed range in the heartbeat's `copied` rows (the ring's `copies`, which
start each old owner's hand-over: join_tails.py) and, once an old owner's marker came,
builds that owner's route (`route_of`: its links to c1
opened), serves it on a thread of its own and lists it in the heartbeat's `adopted` rows
(the manager's takeover rows, where workers find routes: reroute.py) and its keys' chains
in the `heads` rows (what `disttrain ps status` lists: join_status.py). `ps.join`
installs it with replicas >= 2 (joiner.py).
"""

from __future__ import annotations

import copy
import threading
import time

import torch

from disttrain.ps.join_faults import Abandon
from disttrain.ps.join_head import route_id
from disttrain.ps.move import say
from disttrain.ps.replica import Replicas
from disttrain.ps.server import PSError, Server
from disttrain.ps.takeover import RouteThreads

__all__ = ["JoinRoutes", "route_of", "heads", "follow_deaths"]


def route_of(y, head: int, plan, init: dict, policy, optimizer, secret: bytes,
             addresses: dict[int, str], *, host: str, chunk_bytes: int) -> Server:
    """On the joiner `y` (index S = len(plan)): a route serving `head`'s handed keys from
    y's copies, heading their chains as route_id(S, head), its links to the first copies
    (`addresses`: server index -> address) opened. Raises PSError if a key's marker has not
    come. Never blocks."""
    chain, keys = y.chain, sorted(getattr(y.chain, "handed", {}).get(head, ()))
    order = [c for c in plan[head] if c.key in set(keys)]
    if not order or any(k not in chain.params for k in keys):
        raise PSError(f"server {y.index}: no handed copy of server {head}'s keys to serve yet")
    route = Server(head, order, init, copy.deepcopy(policy), optimizer, y.workers, secret,
                   host=host, timeout=y.timeout, chunk_bytes=chunk_bytes)
    old = chain.optimizer.state if chain.optimizer is not None else {}
    with torch.no_grad():
        for c in order:
            src, dst = chain.params[c.key], route.params[c.key]
            dst.copy_(src)
            if src in old:  # NOTE: the momentum (or Adam's moments) goes on, bitwise
                route.optimizer.state[dst] = {n: v.clone() if torch.is_tensor(v) else v
                                              for n, v in old[src].items()}
    want = set(keys)
    clocks = {w: (c, ks & want) for w, (c, ks) in chain.clocks[head].items()}
    if any(ks != want for _, ks in clocks.values()):  # NOTE: X hands over between updates
        raise PSError(f"server {y.index}: server {head} handed keys with a push half applied")
    route.done_clock = {w: c for w, (c, _) in clocks.items()}
    route.grace = route.timeout  # NOTE: workers come once the manager lists it (join_moves.py)
    route.policy.version = chain.version[head]
    route.chain = _head_chain(route, y, head, order, plan, init, optimizer, policy, secret,
                              chunk_bytes)
    route.chain.connect({j: addresses[j] for j in route.chain.origin_hops[route.chain.index]})
    for c in order:  # NOTE: nothing feeds y's copy any more: the route's values go on
        del chain.params[c.key]
        chain.hop.pop(c.key, None)
    return route


def _head_chain(route: Server, y, head: int, order: list, plan, init: dict, optimizer,
                policy, secret: bytes, chunk_bytes: int) -> Replicas:
    """The route's Replicas: party route_id, head of [route, c1, ..., T] for its keys."""
    me = route_id(len(plan), head)
    rc = Replicas(me, len(y.workers), plan, y.chain.r, init, optimizer, policy, route.ep,
                  secret, timeout=y.timeout, chunk_bytes=chunk_bytes)
    rc.patience = y.chain.patience
    for c in order:
        new = [me, *(s for s in y.chain.chains[c.key][1:] if s != y.index)]
        rc.chains[c.key], rc.hop[c.key] = new, new[1] if len(new) > 1 else None
        rc.nbytes[c.key] = c.numel * init[c.name].element_size()
        rc.ranges[tuple(new)].append(c)
        if rc.hop[c.key] is not None:
            rc.origin_hops[me].add(new[1])
            rc.paths[(me, None)].add(new[1])
    return rc


def follow_deaths(route: Server, beat, y: int) -> None:
    """A tick of `route` (on joiner `y`), on its thread: drop from its chain every copy
    the ring (`beat.ring`) marks dead, so its acks stop waiting for that copy; it goes on
    with fewer copies (none made again after a join: not built) and says so."""
    dead = {r["server"] for r in beat.ring.get("servers", ()) if r["state"] == "dead"}
    for j in sorted(dead - route.chain.dead - {route.chain.index}):
        route.chain.drop(j)
        if any(j in route.chain.chains[k] for k in route.keys):
            say(f"[ps server{y}] the route of server {route.index}'s {len(route.keys)} keys "
                f"lost its copy on dead server {j}: it serves them with fewer copies "
                f"(replicas={route.chain.r} is not restored after a join: not built); if "
                f"server {y} dies too, the job stops")


def heads(route: Server, y: int, head: int) -> list[dict]:
    """The `heads` rows of `route` (old owner `head`'s keys served on joiner `y`): each key,
    its bytes and the chain the route heads, the route's party id named as `y` (the
    manager's `record_heads`, join_status.py). Never blocks."""
    rc = route.chain
    return [{"key": k, "bytes": rc.nbytes[k], "owner": head,
             "chain": [y if s == rc.index else s for s in rc.chains[k]]} for k in route.keys]


class JoinRoutes(RouteThreads):
    """The joiner `y`'s watch with replicas >= 2: reports each installed range in
    `beat.copied` (the old owners hand over once the ring lists all of theirs: join_tails.py),
    serves each old owner's handed keys as a route once that owner's `handed` marker came
    (`route_of`), each on a thread of its own, and reports them in `beat.adopted`.
    `intakes`: join_intakes' (old owner, tail) -> Intake. Never blocks; raises PSError if
    a route failed."""

    def __init__(self, y, beat, intakes: dict, plan, init: dict, policy, optimizer,
                 secret: bytes, *, host: str, chunk_bytes: int):
        self.y, self.beat, self.installs = y, beat, intakes
        self.server = y  # NOTE: RouteThreads' host, named in its errors
        self.owners: dict[int, list[str]] = {}  # old owner -> the keys it gives y
        for (x, _), intake in sorted(intakes.items()):
            self.owners.setdefault(x, []).extend(intake.chunks)
        self.intakes = self.owners  # NOTE: the joiner's loop ends once each started
        self.make = lambda x, at: route_of(y, x, plan, init, policy, optimizer, secret, at,
                                           host=host, chunk_bytes=chunk_bytes)
        self.started: set[int] = set()
        self.skipped: set[int] = set()  # NOTE: the joiner's loop ends once all started
        self.routes: list[tuple] = []  # (route, thread, row)
        self.failure: BaseException | None = None
        self.abandon = Abandon(y, intakes, self.owners, len(plan))  # NOTE: a death first
        y.watch = y.takes = self

    def __call__(self) -> None:
        if self.failure is not None:
            raise PSError(f"server {self.y.index}: a route of keys it took failed: "
                          f"{self.failure}")
        rows = [{"server": x, "by": t, "to": self.y.index, "keys": i.stats["keys"],
                 "bytes": i.stats["bytes"], "version": i.stats["version"]}
                for (x, t), i in sorted(self.installs.items())
                if i.stats is not None and (x, t) not in self.abandon.dropped]
        if any(r not in self.beat.copied for r in rows):  # NOTE: a dropped range is not
            self.beat.copied = rows  # reported; replaced whole, as the heartbeat reads it
        handed = getattr(self.y.chain, "handed", {})
        for x, keys in sorted(self.owners.items()):
            if x in self.started | self.skipped or not set(keys) <= handed.get(x, set()):
                continue  # NOTE: x's marker came after every update x applied to them
            self.started.add(x)
            t0, ring = time.monotonic(), self.beat.ring
            at = {r["server"]: r["address"] for r in ring.get("servers", [])}
            route = self.make(x, at)
            row = {"server": x, "by": self.y.index, "address": route.address,
                   "keys": len(route.keys), "bytes": sum(p.numel() * p.element_size()
                                                         for p in route.params.values()),
                   "version": route.policy.version, "after": time.monotonic() - t0}
            route.ticks.append(lambda route=route: follow_deaths(route, self.beat, self.y.index))
            thread = threading.Thread(target=self._serve, args=(route, row), daemon=True,
                                      name=f"ps-route-{x}@{self.y.index}")
            self.routes.append((route, thread, row))
            thread.start()
            self.beat.adopted = [dict(r) for _, _, r in self.routes]
            self.beat.heads = self.beat.heads + heads(route, self.y.index, x)  # NOTE: after adopted
            say(f"[ps server{self.y.index}] serves {row['keys']} keys of server {x} at "
                f"version {row['version']} (ring version {ring.get('version', 0)}), heading "
                f"their chains as {route.chain.index}; workers reach them at {route.address}")
        self.abandon(self.beat.ring, self.started, self.skipped)
