"""A join with `replicas >= 2` whose old server dies before an old owner handed its keys over.

docs/design/parameter-server.md, "A server joins", "With `replicas >= 2`", "Faults". The
tails extended each moved range of old owner X to the joiner Y (join_tails.py: chain [X,
c1, ..., T, Y]); X hands them over once the ring lists Y's installs (join_head.py). If the
ring marks a server of any of X's moved chains dead (X itself or one of its copies) before
X handed over, Y's copy of those ranges is no longer fed whole, so X's part of the join is
abandoned (`broken_owners`, the same answer on every party):

- X, if alive, keeps its keys and heads them on (join_tails.py's head part); X dead: its
  keys are an ordinary takeover (takeover.py: c1 serves them from its copy);
- each live tail T of X's ranges ends its extension to Y (`end_feed`): Y leaves those
  chains, and T sends Y X's `final` marker (a head's end: no new wire field) after every
  update it forwarded, or instead of the cut if it had not cut yet;
- Y (`Abandon`) drops its copies of a range whose feed said final before X's `handed`
  marker came, or whose tail died, and once every range of X is dropped waits no more for X.

Other old owners, none of whose moved chains holds the dead server, go on. A head's
genuine `final` (its job ended before the hand-over) ends Y's copies of it the same way.
Who talks to whom: `end_feed` runs on T's loop (join_tails.py's watch), `take_ends` wraps
Y's `Replicas.hold` (a final of a range never cut), `Abandon` is a part of Y's watch
(join_route.py's `JoinRoutes`).
"""

from __future__ import annotations

import zmq

from disttrain.ps.frame import Message
from disttrain.ps.join_head import repath
from disttrain.ps.move import say

__all__ = ["Abandon", "broken_owners", "dead_servers", "end_feed", "take_ends"]


def dead_servers(ring: dict, servers: int) -> set[int]:
    """The launched servers (index < `servers`) the ring marks dead or left."""
    return {r["server"] for r in ring.get("servers", [])
            if r["state"] in ("dead", "left") and r["server"] < servers}


def broken_owners(pairs: dict, plan, replicas: int, dead: set[int]) -> set[int]:
    """The old owners (of `pairs`: (owner, tail) -> keys, join_tails.tail_pairs) one of
    whose moved keys' chains holds a server of `dead`. Pure; the same on every party."""
    return {x for (x, _), keys in pairs.items()
            if any(dead & set(plan.indices(k, replicas)) for k in keys)}


def end_feed(server, owner: int, keys: list[str], new: int, address: str) -> None:
    """On tail `server`: stop copying `owner`'s `keys` to joiner `new` (at `address`): Y
    leaves their chains here, and a `final` marker of `owner` goes to it after every update
    forwarded so far (a link is opened if none was). Never blocks."""
    ch = server.chain
    for k in keys:
        if ch.hop.get(k) != new:
            continue  # NOTE: never cut: nothing to undo here
        ch.hop[k] = None
        old = tuple(ch.chains[k])
        if old[-1] != new:
            continue  # NOTE: a takeover's recopy renamed the chain (recopy._reshape)
        ch.chains[k] = list(old[:-1])
        chunk = next((c for c in ch.ranges.get(old, []) if c.key == k), None)
        if chunk is not None:
            ch.ranges[old].remove(chunk)
            ch.ranges[old[:-1]].append(chunk)
            if not ch.ranges[old]:
                del ch.ranges[old]
    repath(ch, owner)
    if new not in ch.links:
        server.poller.register(ch.open_link(new, address, [], 0).sock, zmq.POLLIN)
    ch.send(new, Message("replicate", {"origin": owner, "version": ch.version.get(owner, 0),
                                       "lr": 1.0, "final": 1}))


def take_ends(chain, intakes: dict) -> None:
    """On the joiner: a `final` marker of an (owner, tail) range not installed (its tail
    never cut) is taken here (recorded in `chain.finals`, committed); wraps `chain.hold`."""
    before = chain.hold

    def hold(session, msg) -> bool:
        pair = (msg.meta.get("origin"), session.worker - chain.base)
        if (msg.op == "replicate" and msg.meta.get("final") and not msg.keys
                and pair in intakes and intakes[pair].stats is None):
            chain.finals.add(pair)
            chain.received[session.worker] += 1
            chain.ep.send(session, Message("commit", {"frame": chain.received[session.worker]}))
            return True
        return bool(before and before(session, msg))

    chain.hold = hold


class Abandon:
    """The joiner `y`'s part: drop the copies of each (owner, tail) range whose feed ended
    (`final`) before the owner's `handed` marker came, or whose tail died; an owner all of
    whose ranges are dropped is `skipped` (the joiner waits no more for it). Never blocks."""

    def __init__(self, y, intakes: dict, owners: dict, servers: int):
        self.y, self.intakes, self.owners, self.servers = y, intakes, owners, servers
        self.dropped: set[tuple[int, int]] = set()
        self.dead: set[int] = set()

    def __call__(self, ring: dict, started: set[int], skipped: set[int]) -> None:
        chain = self.y.chain
        for d in sorted(dead_servers(ring, self.servers) - self.dead):
            self.dead.add(d)
            chain.drop(d)  # NOTE: a dead tail feeds nothing more: not awaited, not silent
        handed = getattr(chain, "handed", {})
        states = {r["server"]: r["state"] for r in ring.get("servers", [])}
        for (x, t), intake in sorted(self.intakes.items()):
            if x in started or (x, t) in self.dropped or set(intake.chunks) <= handed.get(x, set()):
                continue  # NOTE: a tail that died or exited (the job ended) sends nothing more
            if (x, t) in chain.finals or t in self.dead or states.get(t) == "exited":
                self.dropped.add((x, t))
                _forget(chain, list(intake.chunks), chain.base + t)
                intake.staged = {}
        for x, keys in sorted(self.owners.items()):
            if x in started | skipped or any(p not in self.dropped
                                             for p in self.intakes if p[0] == x):
                continue
            state = states.get(x)
            if x in self.dead:
                why = f"server {x} died before it handed its keys over"
            elif self.dead:
                why = (f"server {x} keeps its keys (a server of their chains, "
                       f"{sorted(self.dead)}, died before it handed them over)")
            elif state in ("exited", None):
                why = f"server {x}'s job ended before it handed its keys over: they stayed on it"
            else:
                continue  # NOTE: the ring names the reason soon (a tail ends a feed after it)
            skipped.add(x)
            say(f"[ps server{self.y.index}] {why}: the copies of its {len(keys)} keys here "
                "are dropped")


def _forget(chain, keys: list[str], peer: int) -> None:
    """Drop this server's copies of `keys` (fed by link `peer`): nothing feeds them."""
    for k in keys:
        p = chain.params.pop(k, None)
        if p is not None and chain.optimizer is not None:
            chain.optimizer.state.pop(p, None)
            for group in chain.optimizer.param_groups:
                group["params"] = [q for q in group["params"] if q is not p]
        chain.expect.get(peer, {}).pop(k, None)
        ch = tuple(chain.chains.get(k, ()))
        if ch in chain.ranges:
            chain.ranges[ch] = [c for c in chain.ranges[ch] if c.key != k]
            if not chain.ranges[ch]:
                del chain.ranges[ch]
