"""Re-replication after a takeover: a key range that lost a copy gets one again.

When server d dies (takeover.py) every chain that held d is one copy short: the route
"d@s" that serves a dead head's keys starts with no copies, and a head (or middle) whose
next server was d is the tail of what is left. Each short chain gets one more server by
chain extension (transfer.py; van Renesse & Schneider 2004, sec. 3), so with
`replicas=2` every range has two copies again and a second death loses nothing
acknowledged. Every server computes the same moves from the plan (`moves`): the short
chain named as the other servers name it (`(d,)` for the route, which speaks as d, else
the live servers before d), the server whose process holds its tail, and the next live
server of the ring (clockwise from the key's point) that holds no copy of it. The tail
extends the chain (`transfer.extend`, from the route's own `Server` for a dead head's
keys), the new copy accepts it (`transfer.accept`) and reports it to the manager
(`report.copied`), which makes it one ring version and an event.

The two ends learn of the death from their own heartbeats, up to a beat apart, so a new
copy may get the state before it knows it should: such frames (and every later frame of
that link) are held, in order, until its takeover watch made the intake, and the link
is refused loudly if none came within twice the timeout (`hold`, `tick`). Only the first
death of a job is re-replicated (a later one is served by its copies, as before).

Who talks to whom: `Takeover` makes one `Recopy`, calls `start` for each dead server and
`tick` every loop, all on the server loop's thread. Docs: docs/design/
parameter-server.md, "Faults and takeover".
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from typing import NamedTuple

from disttrain.ps import transfer
from disttrain.ps.server import PSError

__all__ = ["Move", "moves", "Recopy"]


class Move(NamedTuple):
    """One key of a chain a death left short, and the server that gets a new copy of it."""

    key: str
    chain: tuple[int, ...]
    """the short chain, head first, as every server names it: (d,) for the route serving
    a dead head's keys, else the live servers before the dead one."""
    host: int
    """the server whose process holds the chain's tail (the route's host for (d,))."""
    target: int
    """the next live server of the ring that holds no copy of the key."""


def moves(plan, r: int, dead: set[int], d: int) -> list[Move]:
    """The keys whose chains server d's death left short, with their new copies; empty
    unless d is the only dead server and r >= 2. Pure: the same on every rank."""
    if r < 2 or dead != {d}:
        return []
    out, routes = [], {}  # target -> the one route host it takes copies from
    for c in (c for chunks in plan for c in chunks):
        chain = plan.indices(c.key, r)
        if d not in chain:
            continue
        short = (d,) if chain[0] == d else tuple(chain[:chain.index(d)])
        host = chain[1] if chain[0] == d else short[-1]
        target = next((j for j in plan.indices(c.key, len(plan)) if j != d
                       and j not in (host, *short)
                       and (short != (d,) or routes.get(j, host) == host)), None)
        if target is None:
            continue
        if short == (d,):  # NOTE: every route speaks as d: two may not feed one server
            routes[target] = host
        out.append(Move(c.key, short, host, target))
    return out


def _reshape(chain, keys: list[str], new: tuple[int, ...]) -> None:
    """Name `keys`' chains `new` on this server (the range bookkeeping follows)."""
    for k in keys:
        old = tuple(chain.chains[k])
        chunk = next((c for c in chain.ranges.get(old, []) if c.key == k), None)
        chain.chains[k] = list(new)
        if chunk is not None:
            chain.ranges[old].remove(chunk)
            if not chain.ranges[old]:
                del chain.ranges[old]
            chain.ranges[new].append(chunk)


class Recopy:
    """Server `take.server`'s part in re-replication: the extensions whose tail it holds,
    the intakes it is the new copy of, the frames that came before it knew."""

    def __init__(self, take):
        self.take, self.server, self.chain = take, take.server, take.server.chain
        base = self.chain.base
        self.server.ep.workers |= {base + j for j in range(len(take.plan))}  # NOTE: any
        self.chain.hold = self.hold  # server may become a predecessor of a new copy
        self.early: dict[int, list] = {}  # peer -> [(session, msg, when)] before its intake
        self.intakes: dict[int, list] = defaultdict(list)  # peer -> [(Intake, row, of a
        # route)], in the order the tail cuts them
        self.reported: list[dict] = []

    def _kw(self, replicas: int) -> dict:
        t = self.take
        return {"replicas": replicas, "secret": t.secret, "chunk_bytes": t.chunk_bytes}

    def start(self, d: int, route) -> None:
        """Server d is dead (this server dropped it; `route` serves the keys it took over,
        None if none): extend the short chains whose tail is here, expect the ranges that
        come here. Never blocks."""
        t, me = self.take, self.server.index
        todo = moves(t.plan, self.chain.r, t.dead, d)
        at = {row["server"]: row.get("address") for row in t.beat.ring.get("servers", [])}
        tails, news = defaultdict(list), defaultdict(list)
        for m in todo:
            if m.host == me:
                tails[(m.chain, m.target)].append(m.key)
            if m.target == me:
                news[(m.chain, m.host)].append(m.key)
        for (short, target), keys in sorted(tails.items()):
            self._extend(d, route, short, target, at.get(target), keys)
        before = self.chain.intake  # NOTE: another transfer's (a join's) keeps its handler
        for (short, host), keys in sorted(news.items()):  # NOTE: the order tails cut them in
            if short == (d,):  # NOTE: the route's link numbers its frames from 1, as d's did
                self.chain.received[self.chain.base + d] = 0
            _reshape(self.chain, keys, short)
            intake = transfer.accept(self.server, t.plan, t.init, t.optimizer, short[-1], keys,
                                     **self._kw(self.chain.r))
            self.intakes[self.chain.base + short[-1]].append(
                (intake, {"server": short[0], "by": host, "to": me}, short == (d,)))
        self.chain.intake = before  # NOTE: transfers reach these intakes through `hold`
        for peer in [p for p in self.early if p in self.intakes]:
            for session, msg, _ in self.early.pop(peer):
                self.chain.handle(session, msg)

    def _extend(self, d: int, route, short: tuple, target: int, address: str | None,
                keys: list[str]) -> None:
        t, me = self.take, self.server.index
        if address is None:
            raise PSError(f"server {me}: the ring lists no address for server {target}, which "
                          f"should get a copy of {len(keys)} keys of server {short[0]}")
        if short[0] == d:  # NOTE: the route is the tail: it extends its own chain
            transfer.extend(route, t.plan, t.init, t.optimizer, keys, target, address,
                            **self._kw(1))
            route.chain.r = self.chain.r  # NOTE: what its links and workers say in hellos
            route.chain.patience = self.chain.patience  # NOTE: the manager's verdict first
            want = set(keys)
            route.chain.clocks[d] = {w: (c, set(ks) & want)
                                     for w, (c, ks) in self.chain.clocks[d].items()}
            route.ticks.append(lambda: self._follow(route))
        else:
            _reshape(self.chain, keys, short)
            transfer.extend(self.server, t.plan, t.init, t.optimizer, keys, target, address,
                            **self._kw(self.chain.r))
        print(f"[ps server{me}] copies {len(keys)} keys of server {short[0]} to server "
              f"{target}: replicas={self.chain.r} again once it installed them",
              file=sys.stderr, flush=True)

    def orphans(self, x: int) -> list[tuple[int, list[str]]]:
        """Server x died: the ranges of a route it hosted that were copied here, to be
        served from here now, as (dead head, keys). Raises PSError for one whose copy x
        had not finished: no live server holds those keys whole."""
        out = []
        for intakes in self.intakes.values():
            for intake, row, of_route in intakes:
                if row["by"] != x or not of_route:
                    continue
                if intake.stats is None:
                    raise PSError(f"server {self.server.index}: server {x} died before it "
                                  f"finished copying {len(intake.chunks)} keys of dead server "
                                  f"{row['server']} here: no live server holds them whole")
                out.append((row["server"], list(intake.chunks)))
        return out

    def _follow(self, route) -> None:
        """On the route's thread: drop from its chain the servers the ring marked dead
        since (its new copy among them: its acks then stop waiting for it)."""
        for j in self.take.dead_now - route.chain.dead - {route.index}:
            route.chain.drop(j)

    def hold(self, session, msg) -> bool:
        """A predecessor's frame, before the chain sees it: True if taken here (a
        transfer for an intake, or held until one exists)."""
        peer = session.worker
        if peer in self.early and msg.op not in ("hello", "beat"):
            self.early[peer].append((session, msg, time.monotonic()))
            return True
        if msg.op != "transfer":
            return False
        if peer not in self.intakes:
            if self.chain.intake is not None:  # NOTE: another transfer this server expects
                return False
            self.early[peer] = [(session, msg, time.monotonic())]
            return True
        intake = next((i for i, *_ in self.intakes[peer] if i.stats is None), None)
        if intake is None:
            return False  # NOTE: refused by the chain: no transfer is due from it
        intake.handle(session, msg)
        return True

    def tick(self) -> None:
        """Report installed copies; raise PSError for state no death moved here."""
        now, limit = time.monotonic(), 2 * self.server.timeout
        for peer, frames in self.early.items():
            if now - frames[0][2] > limit:
                raise PSError(f"server {self.server.index}: server {peer - self.chain.base} "
                              f"sent it the state of keys no ring it read moves here (held "
                              f"{now - frames[0][2]:.1f}s, limit {limit:g}s)")
        rows = [dict(row, keys=i.stats["keys"], bytes=i.stats["bytes"],
                     version=i.stats["version"])
                for intakes in self.intakes.values() for i, row, _ in intakes
                if i.stats is not None]
        new = [r for r in rows if r not in self.reported]
        if new:
            for row in new:
                print(f"[ps server{self.server.index}] holds a copy of {row['keys']} keys of "
                      f"server {row['server']} again, from server {row['by']} at version "
                      f"{row['version']}", file=sys.stderr, flush=True)
            self.reported = rows
            self.take.beat.copied = [dict(r) for r in rows]
