"""A server joins a job with `replicas >= 2`: the tails copy the moved ranges to it.

Step 2 of the join with replicas (docs/design/parameter-server.md, "A server joins", "With
`replicas >= 2`"). The joiner Y takes the keys it takes with r = 1 (join_chains.py: the
moved keys of each old owner X, chain [X, c1, ..., T]). Each tail T extends those chains
to Y by chain extension (transfer.py; van Renesse & Schneider 2004, sec. 3), so the range
holds r + 1 copies, Y the last: T cuts between two updates it applied (a tail applies a
`replicate` frame whole, so any loop turn is such a point: no clean point at the head is
needed), and from the cut on T's commits of those keys, and therefore X's acks and pull
answers, wait for Y's commits too. Y admits one Intake per (old owner, tail) pair (an
extension carries one head's keys) and tells a `transfer` frame's intake by the link it
came on and the head it names (`origin`).

Every party computes the same pairs from the model, the servers launched, r and the
joiner's index, so the manager sends no key lists. A joiner the ring marks dead before
the hand-over is dropped from the chains it was added to (r copies again, nothing
awaited from it); a head's job that ended before the cut skips it (transfer.py). An old
server the ring marks dead before an owner handed over abandons that owner's part if one
of its moved chains holds it: the owner keeps its keys, the tails end their copies to the
joiner with the owner's final marker (join_faults.py).

Who talks to whom: `TailJoins` is every server's watch with replicas >= 2 and a manager
(connect.py): it runs the watch it wraps (takeover and drain, handover.py) first, then
its own part, on the server loop's thread. `join_intakes` is the joiner's side, called
before its loop serves. The watch also starts its server's part as an old owner: once
the ring lists the joiner's install of each of its moved ranges (`copies` rows, which the
joiner reports: join_route.py), it hands them over (join_head.py); and it makes its
server's copies follow `handed` markers. The joiner's side: `join_intakes` and
join_route.py, both installed by `ps.join` (joiner.py).
"""

from __future__ import annotations

import time

from disttrain.ps.join_chains import extensions, join_moves
from disttrain.ps.join_faults import broken_owners, dead_servers, end_feed, take_ends
from disttrain.ps.join_head import HeadHandover, follow_handed
from disttrain.ps.join_moves import JoinWatch, joiner
from disttrain.ps.move import say
from disttrain.ps.transfer import Intake, accept, extend

__all__ = ["TailJoins", "join_intakes", "tail_pairs"]

_NEW_PATIENCE = 3.0
"""x timeout a tail waits for the joiner's commits: a fresh process pays first-use costs
on its first frames (join_moves.py says the same for r = 1)."""


def tail_pairs(params, plan, new: int, replicas: int, chunk_bytes: int,
               tail: int | None = None) -> dict[tuple[int, int], list[str]]:
    """(old owner, tail) -> the keys that tail extends to joining server `new`, in plan
    order; only tail `tail`'s pairs if given. Pure; the same on every rank."""
    pairs = extensions(join_moves(params, plan, new, replicas, chunk_bytes))
    return {p: keys for p, keys in pairs.items() if tail is None or p[1] == tail}


class TailJoins(JoinWatch):
    """Server T's watch for a join with replicas >= 2: runs `inner` (the watch it wraps),
    then, once the ring lists a joiner that admitted every link (`accepting` = its own
    index), extends to it each moved range whose tail T is. Never blocks."""

    def __init__(self, inner, server, beat, params, plan, init: dict, optimizer,
                 secret: bytes, *, chunk_bytes: int):
        self.inner, self.server, self.beat, self.params, self.plan = (
            inner, server, beat, params, plan)
        self.init, self.optimizer, self.secret, self.chunk_bytes = (
            init, optimizer, secret, chunk_bytes)
        self.new: int | None = None  # the joining server
        self.pairs: dict[tuple[int, int], list[str]] = {}  # what this tail extends to it
        self.exts: dict[int, object] = {}  # old owner -> transfer.Extension (None: not cut)
        self.ended: set[int] = set()  # old owners whose copy to the joiner this tail ended
        self.broken: tuple[int, set[int]] = (-1, set())  # ring version -> owners a death broke
        self.every: dict[tuple[int, int], list[str]] = {}  # every (owner, tail) -> keys
        self.gives: dict[tuple[int, int], list[str]] = {}  # this server's moved ranges
        self.hand: HeadHandover | None | bool = None  # their hand-over (False: kept)
        self.listed = 0.0  # when the ring first listed the joiner's install of each of them
        self.done = False
        self.seen = -1  # the last ring version looked at for a join
        server.watch = self
        follow_handed(server.chain, len(plan))  # NOTE: a head's hand-over marker passes

    def __call__(self) -> None:
        self.inner()
        self.server.watch = self  # NOTE: a watch it wraps may make itself the watch again
        ring = self.beat.ring
        if "servers" not in ring or self._looks_for_join(ring):
            return
        state = {r["server"]: r["state"] for r in ring["servers"]}.get(self.new)
        if self.broken[0] != ring["version"]:  # NOTE: once per ring version: it hashes keys
            self.broken = (ring["version"], broken_owners(
                self.every, self.plan, self.server.chain.r, dead_servers(ring, len(self.plan))))
        broken = self.broken[1]
        if self.gives and self.hand is None and state not in ("dead", "left", None):
            self._hand(ring, broken)  # NOTE: the head's part; the rest is the tail's
        if self.done:
            return
        if state in ("dead", "left", None):
            return self._lost()
        address = next(r["address"] for r in ring["servers"] if r["server"] == self.new)
        if not self.exts:
            if not any(y == x == self.new for y, x in ring.get("accepting", [])):
                return  # NOTE: the joiner admits every tail's link before any cuts
            self._cut(address, broken)
        handed = getattr(self.server.chain, "handed", {})
        for (x, _), keys in sorted(self.pairs.items()):
            ext = self.exts[x]
            if x in self.ended or not (x in broken or ext is None or "skipped" in (ext.stats or {})):
                continue
            if set(keys) <= handed.get(x, set()):
                continue  # NOTE: x handed them over first: its marker passed here
            self.ended.add(x)
            end_feed(self.server, x, keys, self.new, address)
            say(f"[ps server{self.server.index}] ends its copy of {len(keys)} keys of server "
                f"{x} to joining server {self.new}: " + (
                    "a server of their chains died before the hand-over" if x in broken
                    else f"server {x}'s job ended first"))

    def _cut(self, address: str, broken: set[int]) -> None:
        """Extend each moved range whose tail this server is to the joiner now (a range of
        an owner `broken` by a death is not cut: its feed ends instead)."""
        s = self.server
        for (x, _), keys in sorted(self.pairs.items()):
            if x in broken:
                self.exts[x] = None
                continue
            self.exts[x] = extend(s, self.plan, self.init, self.optimizer, keys, self.new,
                                  address, replicas=s.chain.r, secret=self.secret,
                                  chunk_bytes=self.chunk_bytes)
            self.exts[x].tick()  # NOTE: cut now: between two updates this tail applied
        s.chain.patience = max(s.chain.patience, _NEW_PATIENCE)
        cut = [f"{len(keys)} keys of server {x}" for (x, _), keys in sorted(self.pairs.items())
               if self.exts[x] is not None]
        if cut:
            say(f"[ps server{s.index}] copies {', '.join(cut)} to joining server {self.new} "
                "(the tail of their chains)")

    def _begin(self, ring: dict) -> None:
        """A join at this ring version: the moved ranges whose tail this server is."""
        new = joiner(ring) if "expected" in ring else None
        if new is None:
            return
        s = self.server
        self.new = new
        every = tail_pairs(self.params, self.plan, new, s.chain.r, self.chunk_bytes)
        self.every = every  # NOTE: an owner's hand-over is abandoned on any of its chains' deaths
        self.pairs = {p: keys for p, keys in every.items() if p[1] == s.index}
        self.gives = {p: keys for p, keys in every.items() if p[0] == s.index}
        self.done = not self.pairs

    def _hand(self, ring: dict, broken: set[int]) -> None:
        """This server gives keys to the joiner: hand them over (join_head.py) once the
        ring lists the joiner's install of each of its moved ranges (its `copied` rows);
        keep them if a server of their chains died first (join_faults.py)."""
        if self.server.index in broken:
            self.hand = False
            say(f"[ps server{self.server.index}] keeps its "
                f"{sum(len(k) for k in self.gives.values())} keys for joining server "
                f"{self.new}: a server of their chains died before it handed them over")
            return
        installed = {(r["server"], r["by"]) for r in ring.get("copies", [])
                     if r["to"] == self.new}
        if not set(self.gives) <= installed:
            return
        keys = {k for ks in self.gives.values() for k in ks}
        ch = self.server.chain
        self.listed = self.listed or time.monotonic()  # NOTE: when the ring first listed them
        if not all(ch.heard_since(j, self.listed) for j in {ch.hop.get(k) for k in keys} - {None}):
            return  # NOTE: a next copy that died is marked dead seconds later: wait for its word
        self.hand = HeadHandover(self.server, [k for k in self.server.keys if k in keys],
                                 ring["version"])

    def _lost(self) -> None:
        """The joiner is gone before the hand-over: drop it from the chains it was added
        to; those ranges keep their r copies (nothing more is sent to it or awaited)."""
        self.done = True
        if self.exts:
            self.server.chain.drop(self.new)
        handed = getattr(self.server.chain, "handed", {})
        if any(set(keys) <= handed.get(x, set()) for (x, _), keys in self.pairs.items()):
            return say(f"[ps server{self.server.index}] joining server {self.new} died after "
                       "the hand-over: the keys it headed are served by their first live "
                       "copies (takeover.py)")
        say(f"[ps server{self.server.index}] joining server {self.new} is gone before it "
            f"served: the {sum(len(k) for k in self.pairs.values())} keys this server was "
            "copying to it keep their chains")

    def finish(self, wait: float) -> list[dict]:
        """The wrapped watch's rows (routes this server hosted: takeover.py)."""
        return self.inner.finish(wait)


def join_intakes(server, params, plan, init: dict, optimizer, replicas: int, *,
                 secret: bytes, chunk_bytes: int) -> dict[tuple[int, int], Intake]:
    """On the joiner `server` (index beyond the plan's servers): admit every tail's link
    and the keys it will send, one Intake per (old owner, tail); a `transfer` frame goes to
    the intake of its link and head. Call before `server.serve()`; does not block."""
    intakes = {pair: accept(server, plan, init, optimizer, pair[1], keys, replicas=replicas,
                            secret=secret, chunk_bytes=chunk_bytes)
               for pair, keys in tail_pairs(params, plan, server.index, replicas,
                                            chunk_bytes).items()}
    chain = server.chain
    if not intakes:
        return intakes
    first = next(iter(intakes.values()))  # NOTE: refuses a frame no pair expects, by reason

    def route(session, msg) -> None:
        pair = (msg.meta["origin"], session.worker - chain.base)
        intakes.get(pair, first).handle(session, msg)

    chain.intake = route
    follow_handed(chain, len(plan))
    take_ends(chain, intakes)  # NOTE: a range's feed may end before its cut (join_faults.py)
    return intakes
