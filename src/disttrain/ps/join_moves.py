"""A server joins a running job and takes its share of keys (replicas=1): the old owners' side.

The drain's design (move.py) in the other direction. A new server Y (index S, beyond the
S servers launched; joiner.py) registers with the manager by `join`: the manager marks it
JOINING (a new ring version; membership.py). Every party computes the same moves from the
ring: the bounded-load placement (placement.py) of the model on servers 0..S-1 and Y and,
of it, only the keys whose new owner is Y (`joined_owners`): keys the new placement would
move between two old servers (its cascade) stay where they are. Then each old owner X of
such keys, in order:

1. *Copy.* Once Y says it is ready (its heartbeats carry `accepting` = Y: it admitted every
   old owner's link and keys) and X holds no half-arrived push, X extends the moved keys'
   chains to Y (transfer.extend, chain extension): Y installs their values and optimizer
   state, every later update of them reaches Y after it, each acknowledged only once Y has
   it.
2. *Hand over.* At the first loop turn where X holds no received push it has not applied
   (between two Sync rounds; between two pushes for Async), X takes no frame more: every
   worker gets `moved` (the join's ring version), and so does any frame that reaches X's
   old address later: a push is applied whole by X (before) or refused whole (after),
   never half. In the same loop turn X starts a route "X@X" for the keys it keeps (a
   `Server` of their own in X's process, takeover.py's route: X's values, momentum,
   version and per-worker push clocks) and sends its final marker down the moved keys'
   chains; Y, holding every update X applied, serves the moved keys as a route "X@Y".
   Both are reported in `adopted` and listed in the ring's `takeovers`.
3. *Workers.* A worker told `moved` asks the manager (reroute.py), computes the same
   owners, and once both routes are listed opens them and sends again what X had not
   acknowledged, split by key (a route skips a push its clocks hold).

X keeps serving its other keys, on a new address: routing those through a route of their
own makes the switch-over point the drain's (all of X's frames before it are X's, all
after it the routes'), so a worker needs no field saying which ring it routes by. Docs:
docs/design/parameter-server.md, "Live membership".
"""

from __future__ import annotations

import copy
import time

import torch

from disttrain.ps.frame import Message
from disttrain.ps.membership import JOINING
from disttrain.ps.move import Handoff, Moves, say
from disttrain.ps.placement import place
from disttrain.ps.server import Server
from disttrain.ps.transfer import extend

__all__ = ["JOINING", "joiner", "joined_owners", "Joins", "Giving", "routes_done"]


_NEVER = 2**62  # an Extension's at_version: Joins cuts it itself, between two pushes
_NEW_PATIENCE = 3.0
"""x timeout an old owner waits for the joiner's commits: a fresh process pays its
first-use costs on its first frames (seen: more than a 5 s timeout on a loaded 2-core
machine); a joiner that died is marked dead by the manager meanwhile."""


def joiner(ring: dict) -> int | None:
    """The server that joined the ring beyond the ones launched (at most one), or None."""
    added = [r["server"] for r in ring.get("servers", []) if r["server"] >= ring["expected"]]
    return added[0] if added else None


def joined_owners(params: list[tuple[str, int, int]], servers: int, new: int, old: int,
                  keys: list[str], chunk_bytes: int) -> dict[str, int]:
    """Where each of `keys` (server `old`'s, of a job launched with `servers`) is served once
    server `new` joined: `new` where the placement on 0..servers-1 and `new` puts it, else
    `old` (no cascade between old servers). Pure; the same on every rank; in keys' order."""
    p = place(params, [f"server{s}" for s in [*range(servers), new]], chunk_bytes=chunk_bytes)
    name = f"server{new}"
    out = {k: new if p.owner(k) == name else old for k in keys}
    if all(o == new for o in out.values()):  # NOTE: old keeps a key, so its route "old@old"
        out[keys[0]] = old  # always has one: it tells the joiner that old handed over
    return out


class Giving(Handoff):
    """takeover.py's route, started for keys an old owner gave (to a joiner, or its own)."""

    gone_as = "giving"

    def serve(self, d: int, route: Server, ring: int, t0: float) -> None:
        """Serve `route` (keys server d gave) on a thread of its own; report it."""
        self._start(d, route, ring, t0)


class JoinWatch:
    """A server's watch for a join (Joins, TailJoins): until the ring names a joiner it
    looks for one once per ring version (`_begin`, which sets `new` when it finds it)."""

    new: int | None  # the joining server (None: none yet); set by the subclass
    seen: int  # the last ring version looked at for a join (-1 at first)

    def _looks_for_join(self, ring: dict) -> bool:
        """True while no joiner was known at this call (nothing more to do this turn);
        looks for one (`_begin`) if `ring`'s version is new to it. Never blocks."""
        if self.new is not None:
            return False
        if ring["version"] != self.seen:  # NOTE: once per ring version until a join
            self.seen = ring["version"]
            self._begin(ring)
        return True

    def _begin(self, ring: dict) -> None:
        raise NotImplementedError


class Joins(JoinWatch):
    """Old owner X's watch on the manager's ring for a join (replicas=1): copies the keys
    the joiner takes, hands them over with its own as routes. Wraps the drain's watch
    (move.py), which goes on. Runs on the server loop (`Server.watch`); never blocks."""

    def __init__(self, moves: Moves, server: Server, beat, params, plan, init: dict, policy,
                 optimizer, secret: bytes, *, host: str, chunk_bytes: int):
        self.moves, self.server, self.beat, self.params, self.plan = (
            moves, server, beat, params, plan)
        self.init, self.optimizer, self.secret = init, optimizer, secret
        self.host, self.chunk_bytes = host, chunk_bytes
        self.policy = copy.deepcopy(policy)  # NOTE: before the server steps: a fresh instance
        self.new: int | None = None  # the joining server
        self.ring = 0  # the ring version the join was seen at
        self.keys: list[str] = []  # this server's keys that move to it
        self.ext = None
        self.copied = 0  # frames sent to the joiner up to the cut's last
        self.handoff: Giving | None = None
        self.done = False
        self.seen = -1  # the last ring version looked at for a join
        server.watch = self

    def __call__(self) -> None:
        self.moves()
        self.server.watch = self  # NOTE: a drain's hand-over makes Moves the watch again
        if self.handoff is not None and self.handoff.failure is not None:
            raise self.handoff.failure
        ring = self.beat.ring
        if self.done or "servers" not in ring or self._looks_for_join(ring):
            return
        s = self.server
        if len(s.finished) >= len(s.workers):  # NOTE: the job ended first: the keys stay here
            self.done = True
            return
        if any(r["server"] == self.new and r["state"] == "dead" for r in ring["servers"]):
            self.done = True  # NOTE: before the hand-over: this server keeps its keys
            if self.ext is not None:
                s.chain.drop(self.new)
            say(f"[ps server{s.index}] joining server {self.new} died before it took the "
                f"keys: they stay here")
            return
        if self.ext is None:
            if not any(y == x == self.new for y, x in ring.get("accepting", [])) or s.partial:
                return  # NOTE: cut between two pushes, once the joiner admitted our link
            address = next(r["address"] for r in ring["servers"] if r["server"] == self.new)
            self.ext = extend(s, self.plan, self.init, self.optimizer, self.keys, self.new,
                              address, replicas=1, secret=self.secret,
                              chunk_bytes=self.chunk_bytes, at_version=_NEVER)
            s.chain.patience = max(s.chain.patience, _NEW_PATIENCE)
            self.ext.cut()
            self.copied = s.chain.sent[self.new]  # the frames that carry the state
            return
        if s.partial or s.complete:  # NOTE: a received push is applied here first, whole
            return
        if s.chain.committed[self.new] < self.copied:  # NOTE: hand over once the joiner holds
            return  # the state: one that dies before leaves the keys here (marked dead above)
        self._hand_over(ring)

    def _begin(self, ring: dict) -> None:
        """A join at this ring version: which of this server's keys move to the joiner."""
        new = joiner(ring)
        if new is None:
            return
        me = self.server.index
        self.new, self.ring = new, ring["version"]
        owners = joined_owners(self.params, len(self.plan), new, me,
                               [c.key for c in self.plan[me]], self.chunk_bytes)
        self.keys = [k for k, o in owners.items() if o == new]
        self.done = not self.keys
        say(f"[ps server{me}] server {new} joins (ring version {self.ring}): "
            f"{len(self.keys)} of its {len(owners)} keys move to it")

    def _hand_over(self, ring: dict) -> None:
        """Take no frame more on the old address; serve the kept keys as route "X@X"."""
        s, t0, self.done = self.server, time.monotonic(), True
        moving = set(self.keys)
        kept = [c.key for c in self.plan[s.index] if c.key not in moving]
        before = set(s.finished)
        s.finished |= set(s.workers)  # NOTE: the loop takes no frame more, ends once committed
        s.gone = Message("moved", {"ring": self.ring})
        for w in [w for w in s.workers if w in s.ep.active]:
            s.ep.send(s.ep.active[w], s.gone)
        if kept:
            self.handoff = Giving(s, self.beat, self.plan, self.init, self.policy,
                                    self.optimizer, self.secret, host=self.host,
                                    chunk_bytes=self.chunk_bytes)
            s.watch = self
            self.handoff.serve(s.index, self._own_route(kept, before), ring["version"], t0)
        st = self.ext.stats
        say(f"[ps server{s.index}] handed {st['keys']} keys ({st['bytes'] / 1e6:.2f} MB with "
            f"optimizer state) to joining server {self.new} at version {s.policy.version}; "
            f"cut paused it {st['pause_s'] * 1e3:.1f} ms; keeps {len(kept)} keys")

    def _own_route(self, kept: list[str], before: set[int]) -> Server:
        """A Server for this server's kept keys: its values, optimizer state, version and
        the pushes it applied (all whole: it hands over between two pushes)."""
        s = self.server
        route = Server(s.index, [c for c in self.plan[s.index] if c.key in set(kept)],
                       self.init, copy.deepcopy(self.policy), self.optimizer, s.workers,
                       self.secret, host=self.host, timeout=s.timeout,
                       chunk_bytes=self.chunk_bytes)
        old = s.optimizer.state if s.optimizer is not None else {}
        with torch.no_grad():
            for k in kept:
                src, dst = s.params[k], route.params[k]
                dst.copy_(src)
                if src in old:  # NOTE: the momentum (or Adam's moments) goes on, bitwise
                    route.optimizer.state[dst] = {n: v.clone() if torch.is_tensor(v) else v
                                                  for n, v in old[src].items()}
        route.policy.version = s.policy.version
        # NOTE: workers open a route only once the manager lists every route of this
        # hand-over; if the joiner dies first they never come, and each fails naming it
        # once the manager marks it dead (one timeout). Until then a worker never heard
        # from is not lost here (its error, not this route's, must be the job's first)
        route.grace = route.timeout
        route.done_clock = {w: c for w, (c, _) in s.chain.clocks.get(s.index, {}).items()}
        for w in sorted(before):  # NOTE: said done here already
            route.finished.add(w)
            route.policy.leave(w)
        return route

    def finish(self, wait: float) -> list[dict]:
        """Wait for the routes this server started (a drain's: at most `wait` s; a join's
        own route serves to the job's end: until its workers are done or lost); their rows."""
        rows = self.moves.finish(wait)
        return rows + (routes_done(self.handoff) if self.handoff is not None else [])


def routes_done(handoff: Handoff) -> list[dict]:
    """Block until every route of `handoff` ended (each ends once its workers said done, or
    were silent past its timeout: a worker lost), then their rows (takeover.py)."""
    while any(thread.is_alive() for _, thread, _ in handoff.routes):
        time.sleep(0.05)
    return handoff.finish(0.0)
