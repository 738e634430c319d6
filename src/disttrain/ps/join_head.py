"""A server joins a job with `replicas >= 2`: the old owner hands the moved ranges over.

Step 3 of the join with replicas (docs/design/parameter-server.md, "A server joins", "With
`replicas >= 2`"), after the tails extended each moved range of old owner X to the joiner
Y (join_tails.py: chain [X, c1, ..., T, Y]). At a loop turn where X holds no received
push it has not applied (between two Sync rounds, between two pushes for Async; the
drain's clean point, handover.py), X in one turn:

1. answers `moved` (the join's ring version) on every worker session opened before it,
   now and to any later frame of one (`Session.gone`); a worker's new session whose
   hello names only the keys X keeps is served as before (server.py's `_hello` compares
   the hello's keys with the server's): a session, not a wire field, tells the old ring
   from the new one. A push is applied whole before the turn or refused whole after it.
2. sends a `handed` marker down the moved keys' chains: a `replicate` frame with no
   tensors whose `handed` field names the keys (protocol 9), after every update X applied
   to them, so every copy, Y last, then holds exactly X's state of them.
3. removes the moved keys from its server (values, optimizer state, shard, chunk groups)
   and from its chains (their hops; its acks and version markers then follow only the
   kept keys' chains). Its loop goes on, heading the kept keys and copying for other heads.

Each copy that receives a `handed` marker (`follow_handed`) forwards it along those keys'
chains, commits it once the next copies did, and, when no key of that head comes on that
link any more, counts the link's feed as ended (nothing more comes for those keys from
that head, so its loop need not wait for the head's final marker on it). Step 4's copy
side (`relink`): each copy but the joiner then names those keys' chain [route, c1, ...,
T], the route being the joiner's server for X's moved keys under a party id of its own
(`route_id`: S + 1 + X, no new wire field), c1 takes their updates from the route's link
and T forwards nothing more to the joiner.

Who talks to whom: `HeadHandover` is a tick of X's loop (`Server.ticks`); `follow_handed`
wraps a server's `Replicas.hold` (every server with replicas >= 2 and a manager, and the
joiner). What starts the hand-over (the ring listing Y's installs) is the tails' watch
(join_tails.py); the route on Y that serves the moved keys is join_route.py's; the
workers' re-route is reroute.py's.
"""

from __future__ import annotations

from collections import defaultdict

from disttrain.ps.frame import Message
from disttrain.ps.move import say

__all__ = ["HeadHandover", "follow_handed", "hand_over", "repath"]


class HeadHandover:
    """Server X's tick for a join with replicas >= 2: hands `keys` over at the first loop
    turn with no received push pending (`hand_over`). Never blocks; `stats` is None until
    then."""

    def __init__(self, server, keys: list[str], ring: int):
        self.server, self.keys, self.ring = server, list(keys), ring
        self.stats: dict | None = None
        server.ticks.append(self)

    def __call__(self) -> None:
        s = self.server
        if self.stats is not None or s.partial or s.complete:  # NOTE: a received push first
            return
        self.stats = hand_over(s, self.keys, self.ring)


def hand_over(server, keys: list[str], ring: int) -> dict:
    """Hand `keys` (headed here) over now: `moved` on every worker session opened before,
    the `handed` marker down their chains, the keys removed. Call between two updates
    (no received push pending); never blocks. Returns keys, bytes, version, ring."""
    chain, moved = server.chain, set(keys)
    wrong = sorted(moved - set(server.keys))
    if wrong or moved >= set(server.keys):
        raise ValueError(f"server {server.index} hands over {sorted(moved)[:4]}: "
                         + (f"it does not head {wrong[:4]}" if wrong else
                            "it would keep no key (an old owner keeps one, join_chains.py)"))
    gone = Message("moved", {"ring": ring})
    ep = server.ep
    for s in ep.sessions():
        s.gone = gone
    for s in ep.active.values():
        if s.worker in server.workers:
            ep.send(s, gone)
    server.parked.clear()  # NOTE: a waiting pull is answered `moved`, as its session
    per: dict[int, list[str]] = defaultdict(list)
    for k in server.keys:
        if k in moved and chain.hop.get(k) is not None:
            per[chain.hop[k]].append(k)
    meta = {"origin": server.index, "version": server.policy.version, "lr": 1.0, "final": 0}
    for j, ks in sorted(per.items()):
        chain.send(j, Message("replicate", {**meta, "handed": ks}))
    nbytes = _drop(server, moved)
    say(f"[ps server{server.index}] handed {len(moved)} keys ({nbytes / 1e6:.2f} MB) over at "
        f"version {server.policy.version} (ring version {ring}); it keeps {len(server.keys)}")
    return {"keys": len(moved), "bytes": nbytes, "version": server.policy.version,
            "ring": ring}


def _drop(server, moved: set[str]) -> int:
    """Remove `moved` from the server and from its place in their chains; their bytes."""
    chain, params = server.chain, [server.params[k] for k in server.keys if k in moved]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    for group in server.optimizer.param_groups:
        group["params"] = [p for p in group["params"] if all(p is not q for q in params)]
    for p in params:
        server.optimizer.state.pop(p, None)
    server.chunks = [c for c in server.chunks if c.key not in moved]
    server.keys = [c.key for c in server.chunks]
    for k in moved:
        del server.params[k], server.shard[k]
        chain.hop.pop(k, None)
    server.drop_from_pulls(moved)
    mine = {j for k, j in chain.hop.items() if j is not None and chain.chains[k][0] == server.index}
    chain.origin_hops[server.index] = mine
    chain.paths[(server.index, None)] = set(mine)
    for ch, cs in list(chain.ranges.items()):
        chain.ranges[ch] = [c for c in cs if c.key not in moved or ch[0] != server.index]
        if not chain.ranges[ch]:
            del chain.ranges[ch]
    return nbytes


def route_id(servers: int, head: int) -> int:
    """The party id of the route that serves old owner `head`'s moved keys on the joiner
    (server index `servers`, one join per job): servers + 1 + head, above every server
    index, so its links (W + id) and `origin` need no new wire field."""
    return servers + 1 + head


def follow_handed(chain, servers: int) -> None:
    """Make `chain` (a server's Replicas, in a job of `servers` launched servers, the
    joiner's index) take `handed` markers: forward each along its keys' chains, commit it
    once they did, record the keys in `chain.handed` (head -> keys) and, on a copy other
    than the joiner, relink them to their new head (`relink`). Wraps `chain.hold`; never
    blocks."""
    before = chain.hold
    chain.handed = defaultdict(set)

    def hold(session, msg) -> bool:
        if msg.op == "replicate" and "handed" in msg.meta:
            _handed(chain, session, msg, servers)
            return True
        return bool(before and before(session, msg))

    chain.hold = hold


def relink(chain, head: int, keys: list[str], servers: int) -> None:
    """On a copy of `keys` (headed by `head`, handed to the joiner `servers`): their chain
    becomes [route, c1, ..., T] (route_id: the joiner's route replaces the head, the
    joiner's tail copy goes, the route being built from it), so the first copy takes their
    updates from the route's link (link id W + route) under origin route, and the tail
    forwards nothing more to the joiner. Never blocks.

    NOTE: the marker passes every copy before the joiner, so each has relinked before the
    route can exist: nothing it sends needs buffering."""
    route, i, keys = route_id(servers, head), chain.index, set(keys)
    for k in keys:
        old = chain.chains[k]
        chain.chains[k] = new = [route, *(c for c in old[1:] if c != servers)]
        at = new.index(i)
        chain.hop[k] = new[at + 1] if at + 1 < len(new) else None
        for c in [c for c in chain.ranges.get(tuple(old), []) if c.key == k]:
            chain.ranges[tuple(old)].remove(c)  # NOTE: the report lists the new chains
            chain.ranges[tuple(new)].append(c)
    for ch in [ch for ch, cs in chain.ranges.items() if not cs]:
        del chain.ranges[ch]
    prev = {chain.chains[k][chain.chains[k].index(i) - 1] for k in keys}
    if prev == {route}:  # NOTE: the first copy: the route's link feeds it now
        chain.admit(chain.base + route)
        was = chain.expect[chain.base + head]
        chain.expect[chain.base + route].update({k: v for k, v in was.items() if k in keys})
        chain.expect[chain.base + head] = {k: v for k, v in was.items() if k not in keys}
    chain.origins.add(route)
    chain.version[route] = chain.version.get(head, 0)
    chain.clocks[route] = {w: (c, ks & keys) for w, (c, ks) in chain.clocks[head].items()}
    chain.feeds |= {(route, p) for p in prev}
    for o in (head, route):
        repath(chain, o)


def repath(chain, origin: int) -> None:
    """Recompute where `origin`'s updates and markers go on from here (its keys' hops)."""
    chain.origin_hops[origin] = set()
    for key in [p for p in chain.paths if p[0] == origin]:
        del chain.paths[key]
    for k, j in chain.hop.items():
        ch = chain.chains[k]
        if j is not None and ch[0] == origin:
            at = ch.index(chain.index)
            chain.origin_hops[origin].add(j)
            chain.paths[(origin, ch[at - 1] if at else None)].add(j)


def _handed(chain, session, msg: Message, servers: int) -> None:
    """One `handed` marker from a predecessor: checked, recorded, forwarded, committed."""
    peer, o, keys = session.worker, msg.meta["origin"], msg.meta["handed"]
    have, done = chain.expect.get(peer, {}), chain.handed.get(o, set())
    bad = [k for k in keys if k not in have or chain.chains[k][0] != o]
    again = [k for k in keys if k in done]  # NOTE: the joiner's chains keep their head
    odd = msg.tensors or msg.meta["final"]  # NOTE: an update or an end would be dropped
    if bad or again or odd or not keys or len(set(keys)) != len(keys):
        chain.ep.rejected["schema:replicate.handed"] += 1
        why = (f"it copies no keys {bad[:4]} of server {o} from it" if bad else
               f"server {o} handed {again[:4]} over already" if again else
               "it carries tensors or is final: a marker is neither" if odd else
               "it names no keys" if not keys else "it names a key twice")
        chain.ep.send(session, Message("error", {"message": (
            f"server {chain.index} refused a handed marker from server {peer - chain.base}: "
            f"{why}")}))
        return
    chain.received[peer] += 1
    n = chain.received[peer]
    chain.version[o] = max(chain.version.get(o, 0), msg.meta["version"])
    chain.handed[o] |= set(keys)
    per: dict[int, list[str]] = defaultdict(list)
    for k in keys:
        if chain.hop.get(k) is not None:
            per[chain.hop[k]].append(k)
    for j, ks in sorted(per.items()):
        chain.send(j, Message("replicate", {**msg.meta, "handed": ks}))
    if all(k in chain.handed[o] for k in have if chain.chains[k][0] == o):
        chain.finals.add((o, peer - chain.base))  # NOTE: nothing more of o comes on this link
    if chain.index != servers:  # NOTE: after forwarding; the joiner builds the route instead
        relink(chain, o, keys, servers)
    chain.when_committed(lambda: chain.ep.send(session, Message("commit", {"frame": n})),
                         {j: chain.sent[j] for j in per})
