"""A drained server's keys served on by their copies (replicas >= 2): a planned failover.

With `replicas >= 2` every key of server i already lives on the next servers of its chain
(replica.py), so `disttrain ps drain ADDR --server i` moves nothing: the manager marks i
LEAVING (membership.py; refused if a key of i has no live copy elsewhere) and i hands
its keys to those copies as a death would, but at a clean point and without the wait
for a timeout. In order:

1. *Close.* At the first loop turn after i read LEAVING from its heartbeat's answer where
   it holds no received push it has not applied (between two Sync rounds; between two
   pushes for Async), it takes no worker frame more (each gets `moved`, the drain's ring
   version) and no predecessor's update (it is no longer a copy: the heads' chains drop
   it below), and its own chains get its final marker.
2. *Commit.* Its loop ends once everything it sent down its chains is committed: every
   copy holds every update i applied, and every push i acknowledged (its acks wait for
   those commits, as always with replicas) is on them. Its last report says `drained`:
   the manager marks it LEFT (a new version), and its process ends.
3. *Take over.* Every other server reads LEFT like dead (takeover.py): the first live
   server of each chain serves i's keys as a route "i@s" (the copy's values, momentum,
   version and push clocks), heads whose next server was i drop it, and the chains that
   held i get a copy again (recopy.py), so the job is back to r copies.
4. *Workers* told `moved` (or finding i silent) ask the manager, find i LEFT and its
   routes, re-route and send again what i had not acknowledged (reroute.py).

Invariant: an acknowledged push is applied exactly once (i acknowledged only what every
copy committed; a push it did not acknowledge is sent again, and a route skips a push
whose clock its copy holds); a Sync round is summed whole on one server in worker order,
so the run is bitwise the run without the drain. Who talks to whom: the server loop
calls `Handover` every turn (`Server.watch`); it runs the takeover watch first. Docs:
docs/design/parameter-server.md, "Live membership".
"""

from __future__ import annotations

import sys

from disttrain.ps.frame import Message
from disttrain.ps.membership import LEAVING

__all__ = ["Handover"]


class Handover:
    """Server `take.server`'s watch with replicas >= 2 and a manager: the takeover watch
    (`take`, takeover.py), and this server's own hand-over once the ring marks it
    leaving. Never blocks."""

    def __init__(self, take):
        self.take, self.server, self.beat = take, take.server, take.beat
        self.at: int | None = None  # the ring version that marked this server leaving
        self.closed = False
        take.server.watch = self

    def __call__(self) -> None:
        self.take()
        ring = self.beat.ring
        if self.closed or "servers" not in ring:
            return
        if self.at is None:
            me = [r for r in ring["servers"] if r["server"] == self.server.index]
            if not me or me[0]["state"] != LEAVING:
                return
            self.at = ring["version"]
            _say(f"[ps server{self.server.index}] leaving (ring version {self.at}): its "
                 f"{len(self.server.keys)} keys go to their next live copies")
        if self.server.partial or self.server.complete:  # NOTE: a received push is applied first
            return
        self._close()

    def _close(self) -> None:
        """Take no frame more from workers (they are told `moved`) nor predecessors; the
        loop then sends the final marker and ends once every copy committed (Server._ended)."""
        s, chain = self.server, self.server.chain
        self.closed = True
        s.finished |= set(s.workers)
        s.gone = Message("moved", {"ring": self.at})
        for w in [w for w in s.workers if w in s.ep.active]:
            s.ep.send(s.ep.active[w], s.gone)
        chain.feeds = set()  # NOTE: it waits for no head's final: it copies nothing any more
        before = chain.hold
        chain.hold = lambda session, msg: (  # NOTE: uncommitted; the heads drop this server
            msg.op in ("replicate", "transfer") or bool(before and before(session, msg)))
        _say(f"[ps server{s.index}] hands its keys over at version {s.policy.version}: its "
             "copies serve them once they committed its last update")

    def finish(self, wait: float) -> list[dict]:
        """The takeover's rows (routes this server hosted); a server that closed says
        `drained` in its last report (connect.serve sends it after this)."""
        rows = self.take.finish(wait)
        if self.closed:
            self.beat.drained = True
        return rows


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
