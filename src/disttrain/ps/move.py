"""A drained server's keys move to the other servers while workers train (replicas=1).

`disttrain ps drain ADDR --server i` on a server that holds keys: the manager marks i
LEAVING (a new ring version; membership.py). Every server reads it from its next
heartbeat's answer and computes the same thing: the placement without i (placement.py,
bounded loads) gives each of i's keys its new owner Y. Then, in order:

1. *Ready.* Each Y admits i's link and the keys it will take (transfer.accept) and says
   so in its heartbeats (`accepting`: i); the ring lists it.
2. *Copy.* Once every Y is ready, i cuts between two pushes (no push half-arrived) and
   extends the chain of each Y's keys to Y (transfer.extend, chain extension): Y installs
   the values and optimizer state, and every later update of those keys is forwarded to
   it on the same FIFO link, each acknowledged only once Y has it.
3. *Hand over.* At the first moment i holds no received push it has not applied (between
   two Sync rounds; between two pushes for Async), it stops taking frames, sends its
   final marker down the chains and, once Y committed everything, leaves (`drained` in
   its last report: the manager marks it LEFT, a new version) and its process ends.
4. *Serve.* Y, holding every update i applied (its final came after them), serves the
   keys as a route "i@Y" (takeover.py's: a Server of their own, version = i's, momentum
   and clocks of the copy) and reports it (`adopted`): the ring lists it.
5. *Workers.* A worker waiting on i asks the manager (reroute.py), finds i LEFT, the same
   new owners and their routes, opens them and sends again what i had not acknowledged.

Invariant: an acknowledged push is applied exactly once (i acknowledges only what Y
committed; what i did not acknowledge is sent again and a route skips a push whose clock
its copy holds); under Sync a round is summed whole on one server in worker order, so the
run is bitwise the run without the drain. Only i's keys pause, from the hand-over to the
workers' re-route. Docs: docs/design/parameter-server.md, "Live membership".
"""

from __future__ import annotations

import copy
import sys

from disttrain import settings
from disttrain.ps.frame import Message
from disttrain.ps.manager_link import ManagerLink, status_party
from disttrain.ps.membership import LEAVING, LEFT
from disttrain.ps.placement import place
from disttrain.ps.server import PSError
from disttrain.ps.takeover import Takeover
from disttrain.ps.transfer import accept, extend

__all__ = ["Moves", "Handoff", "owners_after", "gone", "drain", "say"]

_NEVER = 2**62  # an Extension's at_version: Moves cuts it itself, between two pushes
_SERVING = ("alive", "exited")  # states whose servers keep their keys


def owners_after(params: list[tuple[str, int, int]], ring: dict, leaving: int,
                 keys: list[str], chunk_bytes: int) -> dict[str, int]:
    """The server each of `keys` (server `leaving`'s) goes to: its owner in the placement
    of `params` on the ring's other serving servers. Pure; the same on every rank."""
    others = sorted(r["server"] for r in ring["servers"]
                    if r["state"] in _SERVING and r["server"] != leaving)
    if not others:
        raise PSError(f"server {leaving} is leaving and no other server serves: its keys "
                      "have nowhere to go")
    if len(others) == 1:  # NOTE: one server keeps whole tensors; it takes every key
        return dict.fromkeys(keys, others[0])
    p = place(params, [f"server{s}" for s in others], chunk_bytes=chunk_bytes)
    return {k: int(p.owner(k).removeprefix("server")) for k in keys}


def drain(server: int, manager: str | None = None, *, timeout: float = 10.0) -> dict:
    """Ask the server manager (default DISTTRAIN_PS_MANAGER) to drain server `server`:
    with replicas=1 its keys move to the other servers while workers train, with
    replicas >= 2 its copies take them over (handover.py); then it leaves (`disttrain ps
    drain ADDR --server i` does the same). Blocks for the answer only (at most `timeout`
    s), not for the move; returns the new ring. Raises ManagerError with the manager's
    reason when refused (the last live copy of a key, the manager, a second drain)."""
    address = manager or settings.current().ps_manager
    if not address:
        raise ValueError("ps.drain: no server manager: pass manager=ADDR or run under "
                         "`disttrain run --servers S` (it exports DISTTRAIN_PS_MANAGER)")
    link = ManagerLink(address, status_party(), timeout=timeout)
    try:
        link.request("lookup")  # NOTE: a change is asked on the current ring version
        return dict(link.request("leave", server=server).meta)
    finally:
        link.close()


def gone(ring: dict) -> dict[int, str]:
    """Servers whose keys are served elsewhere now: index -> "dead" or "left"."""
    return {r["server"]: r["state"] for r in ring["servers"] if r["state"] in ("dead", LEFT)}


class Handoff(Takeover):
    """takeover.py's route, started for a server that left (not one that died)."""

    gone_as = "drained"

    def start(self, d: int, ring: int) -> None:
        self.dead.add(d)
        self._take(d, ring)


class Moves:
    """Server `server`'s watch on the manager's ring for drains (replicas=1): takes its
    share of a leaving server's keys, or hands its own over and ends its loop. Runs on the
    server loop (`Server.watch`); never blocks."""

    def __init__(self, server, beat, params: list[tuple[str, int, int]], plan, init: dict,
                 policy, optimizer, secret: bytes, *, host: str, chunk_bytes: int):
        self.server, self.beat, self.params, self.plan, self.init = (
            server, beat, params, plan, init)
        self.policy = copy.deepcopy(policy)  # NOTE: before the server steps: a fresh instance
        self.optimizer, self.secret, self.host, self.chunk_bytes = (
            optimizer, secret, host, chunk_bytes)
        self.leaving: tuple[int, int] | None = None  # (server, ring version of its drain)
        self.targets: dict[int, list[str]] = {}  # on the leaving server: Y -> its keys
        self.addresses: dict[int, str] = {}
        self.exts: list = []
        self.copied = False  # the leaving server cut and extended every target's chains
        self.intake = None
        self.handoff: Handoff | None = None
        self.ended = False
        self.seen = -1  # the last ring version looked at
        server.watch = self

    def __call__(self) -> None:
        if self.handoff is not None and self.handoff.failure is not None:
            raise PSError(f"server {self.server.index}: the keys it took from server "
                          f"{self.leaving[0]} failed: {self.handoff.failure}")
        ring = self.beat.ring
        if "servers" not in ring or self.leaving is None and ring["version"] == self.seen:
            return  # NOTE: once per ring version while no drain is under way (every loop turn)
        self.seen = ring["version"]
        if self.leaving is None:
            going = [r["server"] for r in ring["servers"] if r["state"] == LEAVING]
            if not going:
                return
            self._begin(going[0], ring)
        if self.leaving[0] == self.server.index:
            self._hand_over(ring)
        elif self.intake is not None and self.handoff is None:
            self._serve_moved(ring)

    def _begin(self, i: int, ring: dict) -> None:
        """A drain of server i at this ring version: whose keys go where."""
        self.leaving = (i, ring["version"])
        keys = [c.key for c in self.plan[i]]
        owners = owners_after(self.params, ring, i, keys, self.chunk_bytes)
        me = self.server.index
        if i == me:
            for k, y in owners.items():
                self.targets.setdefault(y, []).append(k)
            self.addresses = {r["server"]: r["address"] for r in ring["servers"]}
            say(f"[ps server{me}] leaving (ring version {ring['version']}): {len(keys)} keys "
                "move to " + ", ".join(f"server {y} ({len(ks)})"
                                       for y, ks in sorted(self.targets.items())))
            return
        mine = [k for k, y in owners.items() if y == me]
        if mine:
            self.intake = accept(self.server, self.plan, self.init, self.optimizer, i, mine,
                                 replicas=1, secret=self.secret, chunk_bytes=self.chunk_bytes)
            self.beat.accepting = i

    def _hand_over(self, ring: dict) -> None:
        """On the leaving server: copy once every target is ready, end once all is handed."""
        s = self.server
        if not self.copied:
            ready = {y for y, v in ring.get("accepting", []) if v == s.index}
            if not set(self.targets) <= ready or s.partial:  # NOTE: cut between two pushes
                return
            self.copied = True
            for y, keys in sorted(self.targets.items()):
                ext = extend(s, self.plan, self.init, self.optimizer, keys, y,
                             self.addresses[y], replicas=1, secret=self.secret,
                             chunk_bytes=self.chunk_bytes, at_version=_NEVER)
                ext.cut()
                self.exts.append(ext)
            return
        if self.ended or s.partial or s.complete:  # NOTE: a received push is applied here first
            return
        self.ended = True
        s.finished |= set(s.workers)  # NOTE: the loop takes no frame more, ends once committed
        self.beat.drained = True
        s.gone = Message("moved", {"ring": self.leaving[1]})
        for w in [w for w in s.workers if w in s.ep.active]:
            s.ep.send(s.ep.active[w], s.gone)
        moved = [e.stats for e in self.exts]
        pause = max([m["pause_s"] for m in moved], default=0.0)
        say(f"[ps server{s.index}] handed {sum(m['keys'] for m in moved)} keys "
            f"({sum(m['bytes'] for m in moved) / 1e6:.2f} MB with optimizer state) over at "
            f"version {s.policy.version}; cut paused it {pause * 1e3:.1f} ms")

    def _serve_moved(self, ring: dict) -> None:
        """On a target: once the leaving server left and its final marker came (after every
        update it applied), serve its keys as a route."""
        i = self.leaving[0]
        left = any(r["server"] == i and r["state"] == LEFT for r in ring["servers"])
        if not left or self.intake.stats is None or not any(
                o == i for o, _ in self.server.chain.finals):
            return
        self.handoff = Handoff(self.server, self.beat, self.plan, self.init, self.policy,
                               self.optimizer, self.secret, host=self.host,
                               chunk_bytes=self.chunk_bytes)
        self.server.watch = self  # NOTE: the Takeover made itself the watch
        self.handoff.start(i, ring["version"])

    def finish(self, wait: float) -> list[dict]:
        """Wait (at most `wait` s) for the routes of moved keys; their rows (takeover.py)."""
        return self.handoff.finish(wait) if self.handoff is not None else []


def say(text: str) -> None:
    """Print a server's line about a membership change to stderr, flushed at once; the
    drain's and the join's (join_moves.py, joiner.py). Does not block."""
    print(text, file=sys.stderr, flush=True)
