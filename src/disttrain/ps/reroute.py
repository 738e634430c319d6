"""A worker's routes to the servers, and what it does when a server dies: ask, re-route, resend.

A worker starts with one route per server: a link, a version, the keys it serves. With
`replicas >= 2` and a server manager, a server silent for two beat intervals is looked
up in the manager's ring (`lookup`): if the ring marks it dead, each of its keys is now
served by the first live server of the key's chain (takeover.py), under a route "d@s"
whose address the ring's `takeovers` give. The worker opens a link per new route, says
hello with that route's keys, and from then on splits whatever the compute thread still
addresses to d among d's routes (the compute thread never learns: it keeps server
indices 0..S-1). What d had not acknowledged is sent again: every push frame of d not
yet acknowledged (its tensors are referenced until the ack, so nothing is recomputed),
every pull d had not answered (asking for full parameters: d may have died in the middle
of an answer) and every `done` it had not said bye to. A server that is dead with no
copy to take over (replicas=1, or every copy dead) fails the worker at once, naming it
and the fix. Runs on the worker's communication thread only.
"""

from __future__ import annotations

import time
from collections import defaultdict

from disttrain.ps.frame import Message
from disttrain.ps.join_chains import join_moves
from disttrain.ps.join_moves import joined_owners, joiner
from disttrain.ps.manager_link import ManagerError, ManagerLink
from disttrain.ps.membership import LEFT
from disttrain.ps.move import gone, owners_after
from disttrain.ps.recopy import moves
from disttrain.ps.takeover import first_live

__all__ = ["Routes"]

_ASK_EVERY = 0.5  # seconds between two lookups while a server is silent


def _lost(s: int, new: int, ring: dict, where: str = "") -> str:
    """Why the job stops (replicas=1): server s handed keys to joining server `new`, which
    died (with replicas >= 2 their copies take over: takeover.py)."""
    return (f"server {s} handed keys to joining server {new}, which died (the manager's ring "
            f"version {ring['version']} marks it dead{where}): with replicas=1 they are lost; "
            "restart the job (from a snapshot)")


class Routes:
    """Worker `worker`'s failover state: dead servers' routes, unacknowledged pushes."""

    def __init__(self, worker, plan, replicas: int, manager: str | None):
        self.w, self.plan, self.r, self.manager = worker, plan, replicas, manager
        self.on = bool(manager)  # NOTE: replicas=1 too: a drained server's keys move (move.py)
        self.routes: dict[int, dict[str, int]] = {}  # dead server -> key -> its route index
        self.unacked: dict[int, list[list[Message]]] = defaultdict(lambda: [[]])
        self.kept: dict[int, int] = defaultdict(int)  # of them, pushes `held`, not yet acked
        self.waiting_welcome: dict[int, list] = {}  # new route -> what waits for its welcome
        self._held: dict[int, dict[int, list]] = defaultdict(lambda: defaultdict(list))
        self._link: ManagerLink | None = None
        self._asked = 0.0
        self.dead_since: dict[int, float] = {}
        self.first: int | None = None  # the first dead server: its chains got a copy again
        self._again: dict[str, int] | None = None  # key -> that copy's server (recopy.py)
        self.hosts: dict[int, tuple[int, int]] = {}  # route -> (dead server, its host)
        self.moved: set[int] = set()  # routes whose host died too: their keys moved on
        self.why: dict[int, str] = {}  # a server that left, not died: the re-route says so
        self._told: dict[int, int] = {}  # server that said its keys moved -> the drain's ring
        self.after: dict[str, list[int]] = {}  # a join's moved key -> its chain after it (r >= 2)

    # ---- sending ----------------------------------------------------------------------
    def send(self, s: int, msg: Message, replies: list) -> None:
        """Send a frame addressed to server s (to its routes if s is dead); remember a
        push frame until it is acknowledged."""
        if s in self.routes:
            return self._split(s, msg, replies)
        self._put(s, msg, replies)

    def _put(self, s: int, msg: Message, replies: list) -> None:
        if s in self.waiting_welcome:
            self.waiting_welcome[s].append((msg, replies))
            return
        self.w.transmit(s, msg, replies)
        if self.on and msg.op == "push":
            self.unacked[s][-1].append(msg)
            if msg.meta.get("ack"):
                self.unacked[s].append([])

    def acked(self, s: int) -> None:
        """Server s acknowledged its oldest unacknowledged push (an ack or a params frame
        carrying one)."""
        if self.on and len(self.unacked[s]) > 1:
            self.unacked[s].pop(0)
            self.kept[s] = max(0, self.kept[s] - 1)

    def received(self, s: int) -> None:
        """Server s received its oldest push not yet `held` (Server.says_held): copy that
        push's frames, which may be sent again after its handle completed (the compute
        thread may then change `.grad` in place)."""
        if self.on and self.kept[s] < len(self.unacked[s]) - 1:
            for msg in self.unacked[s][self.kept[s]]:
                msg.tensors[:] = [t.clone() for t in msg.tensors]
            self.kept[s] += 1

    def welcome(self, s: int) -> None:
        """A new route said welcome: send what waited for it."""
        for msg, replies in self.waiting_welcome.pop(s, []):
            self._put(s, msg, replies)

    def _split(self, d: int, msg: Message, replies: list) -> None:
        """A frame for dead server d, as frames for its routes. Push frames are held per
        route until the frame that asks for an ack, so each route's last frame asks."""
        meta = {k: v for k, v in msg.meta.items() if k not in ("worker", "shm", "pull")}
        to = sorted(set(self.routes[d].values()))
        if msg.op == "push":
            parts: dict[int, tuple[list, list]] = defaultdict(lambda: ([], []))
            for k, t in zip(msg.keys, msg.tensors):  # NOTE: a sparse key's pair stays together
                parts[self.routes[d][k]][0].append(k)
                parts[self.routes[d][k]][1].append(t)
            for a, part in parts.items():
                self._held[d][a].append(part)
            if not meta.get("ack"):
                return
            acks = [(h, r) for h, r in replies if r in ("held", "ack")]
            frames = self._held.pop(d, {})
            for n, a in enumerate(sorted(frames)):
                for i, (keys, tensors) in enumerate(frames[a]):
                    last = i == len(frames[a]) - 1
                    self._put(a, Message("push", dict(meta, ack=int(last)), keys, tensors),
                              self._share(acks, n) if last else [])
            if "pull" in msg.meta:
                self._split(d, Message("pull", {"have": -1}), [(h, r) for h, r in replies
                                                               if r == "params"])
            return
        for n, a in enumerate(to):
            if msg.op == "pull":
                meta = {"have": self.w.held(a)}
            self._put(a, Message(msg.op, dict(meta)), self._share(replies, n))

    @staticmethod
    def _share(replies: list, n: int) -> list:
        """The replies a frame sent to the n-th of several routes completes: the first
        route's are the original ones, each further route adds one more to the handle."""
        if n:
            for handle, _ in replies:
                if handle is not None:
                    handle.add()
        return list(replies)

    # ---- a silent server ----------------------------------------------------------------
    def silent(self, s: int, quiet: float, beat: float) -> str | None:
        """Server (or route) s has been silent `quiet` s (the worker waits on it, or beats it
        idle: a route counts a worker it never heard from lost after its grace): ask
        the manager whether it is dead and re-route if its keys were taken over. Returns
        an error text when the job cannot go on, else None. Blocks for at most one
        lookup (about a second)."""
        if (not self.manager or s in self.routes or s in self.moved
                or quiet < 2 * beat and s not in self._told
                or s >= len(self.plan) and s not in self.hosts):
            return None
        now = time.monotonic()
        if now - self._asked < _ASK_EVERY:
            return None
        self._asked = now
        try:
            if self._link is None:
                self._link = ManagerLink(self.manager, self.w.rank, timeout=1.0)
            ring = self._link.request("lookup", timeout=1.0).meta
        except ManagerError:
            return None  # NOTE: a slow or restarting manager: the worker's own timeout decides
        states = gone(ring)
        new = joiner(ring)
        if s in self._told and s not in states and new is not None and s < len(self.plan):
            if states.get(new) == "dead" and self.r == 1:  # NOTE: the keys it took died with it
                return _lost(s, new, ring)
            return self._joined(s, new, ring)  # NOTE: handed keys to a joining server (join_moves.py)
        d, host = self.hosts.get(s, (s, s))  # NOTE: a route dies with its host
        if host not in states:
            return None
        if s != d and host == new and self.r == 1:  # NOTE: its route on the joiner died with it
            return _lost(d, new, ring, f"; they were served at {self.w.addresses[s]}")
        self.dead_since.setdefault(s, now)
        where = self.w.addresses[s]
        name = f"server {s}" if s == d else f"server {d}'s route on server {host}"
        if s == d and states[s] == LEFT:
            self.why[s] = "left (drained" + (f", it answered moved at ring version "
                                             f"{self._told[s]}" if s in self._told else "") + ")"
        if s == d and states[s] == LEFT and self.r == 1:  # NOTE: its keys moved (move.py)
            keys = [c.key for c in self.plan[s]]
            spec = [(n, p.numel(), p.element_size()) for n, p in self.w.params.items()]
            owner = owners_after(spec, ring, s, keys, self.w.chunk_bytes)
        elif self.r == 1:
            return (f"server {s} at {where} died (the manager's ring version {ring['version']} "
                    "marks it dead) and with replicas=1 no other server holds its keys: "
                    "start the job with replicas >= 2 (ps.connect(..., replicas=2)) so a copy "
                    "takes over, or with snapshot= and `disttrain run --max-restarts N` to "
                    "restart from a snapshot")
        else:  # NOTE: a drained server's copies serve its keys as a dead one's (handover.py)
            self._first_death(ring, states)
            keys = [c.key for c in self.plan[s]] if s == d else [
                k for k, a in self.routes[d].items() if a == s]
            joined = s != d or self._handed(s, new, ring)
            owner = {k: first_live(self._chain(k, joined), set(states)) for k in keys}
        orphan = [k for k, o in owner.items() if o is None]
        if orphan:
            return (f"{name} at {where} died and every copy of {len(orphan)} of its keys "
                    f"(e.g. {orphan[0]!r}) is dead too (replicas={self.r}): the job cannot go "
                    "on; start it with more replicas, or restart it from a snapshot")
        rows = {t["by"]: t for t in ring.get("takeovers", [])
                if t["server"] == d and t["address"] not in self.w.addresses}
        if set(owner.values()) <= set(rows):
            self._reroute(s, d, owner, rows)
        return None

    def _joined(self, s: int, new: int, ring: dict) -> str | None:
        """Server s handed the keys a joining server takes to it and serves its others on a
        route of its own (replicas=1), or itself (replicas >= 2: a new session at its own
        address whose hello names only them): re-route all of s's keys once the joiner's
        route (and with replicas=1 s's own) is listed."""
        spec = [(n, p.numel(), p.element_size()) for n, p in self.w.params.items()]
        owner = joined_owners(spec, len(self.plan), new, s, [c.key for c in self.plan[s]],
                              self.w.chunk_bytes)
        self.why[s] = (f"handed {sum(o == new for o in owner.values())} keys to joining server "
                       f"{new} (it answered moved at ring version {self._told[s]})")
        rows = {t["by"]: t for t in ring.get("takeovers", [])
                if t["server"] == s and t["address"] not in self.w.addresses}
        if self.r >= 2:  # NOTE: s heads its kept keys on; its old session answers moved
            rows[s] = {"address": self.w.addresses[s], "version": self.w.held(s)}
            self.after = self.after or {m.key: list(m.after) for m in join_moves(
                spec, self.plan, new, self.r, self.w.chunk_bytes)}
            dead = set(gone(ring))  # NOTE: a dead joiner's keys: their first live copy's route
            owner = {k: first_live(self.after[k], dead) if o == new and new in dead else o
                     for k, o in owner.items()}
            orphan = [k for k, o in owner.items() if o is None]
            if orphan:
                return (f"server {s} handed {len(orphan)} keys (e.g. {orphan[0]!r}) to joining "
                        f"server {new}, and it and every copy of them died (the manager's ring "
                        f"version {ring['version']}, replicas={self.r}): the job cannot go on; "
                        "restart it")
        if set(owner.values()) <= set(rows):
            self._reroute(s, s, owner, rows)
        return None

    def told(self, s: int, ring: int) -> None:
        """Server s answered `moved` (drained at ring version `ring`): ask the manager now,
        without waiting for it to fall silent."""
        self._told[s] = ring

    def _first_death(self, ring: dict, states: dict) -> None:
        """Learn the first dead server from the ring when this worker re-routed none yet:
        the dead server whose death's copies (recopy.py's moves, made after the first death
        only) are those the ring lists copied again, by the same hosts. A worker that learns
        of two deaths in one lookup then still counts the copies made after the first."""
        rows = {(r["to"], r["by"]) for r in ring.get("copies", []) if r["to"] < len(self.plan)}
        if self.first is not None or not rows:
            return
        fits = [x for x in states if x < len(self.plan) and rows <= {
            (m.target, m.host) for m in moves(self.plan, self.r, {x}, x)}]
        if len(fits) == 1:
            self.first = fits[0]

    def _handed(self, s: int, new: int | None, ring: dict) -> bool:
        """Dead server s handed keys to joining server `new` before it died: it answered
        moved, or the ring lists the joiner's route of them. Else the join abandoned them
        and they keep their launch chains (join_faults.py), though this worker may know
        the join's chains already (another owner handed over)."""
        return s in self._told or any(t["server"] == s and t["by"] == new
                                      for t in ring.get("takeovers", ()))

    def _chain(self, key: str, joined: bool = True) -> list[int]:
        """`key`'s servers as they hold it: its chain, then the server it was copied to
        again after the first death (recopy.py computes the same on every server); after a
        join (replicas >= 2) the chain it made (join_chains.py), and no copy made again,
        unless not `joined` (its owner died before it handed its keys over: the join
        abandoned them, join_faults.py)."""
        if self.after and joined:
            return self.after.get(key, self.plan.indices(key, self.r))
        if self._again is None and self.first is not None:
            self._again = {m.key: m.target for m in moves(self.plan, self.r, {self.first},
                                                          self.first)}
        chain = self.plan.indices(key, self.r)
        return chain + [t for t in [(self._again or {}).get(key)] if t is not None]

    def _reroute(self, s: int, d: int, owner: dict[str, int], rows: dict[int, dict]) -> None:
        """Open a route per server that took over d's keys (s: server d, or a route of
        d's keys whose host died); send again what s owed."""
        w, index = self.w, {}
        for by in sorted(set(owner.values())):
            keys = [k for k, o in owner.items() if o == by]
            n = index[by] = w.open_route(d, rows[by]["address"], keys, self.r)
            self.waiting_welcome[n] = []
            self.hosts[n] = (d, by)
        self.first = d if self.first is None else self.first
        self.routes.setdefault(d, {}).update({k: index[o] for k, o in owner.items()})
        self.moved |= {s} if s != d else set()
        owed, waiting = self.unacked.pop(s, [[]]), w.owed(s)
        acks, kept = [(h, "ack") for h in waiting.pop("ack", [])], self.kept.pop(s, 0)
        if w.held_acks:  # NOTE: the oldest pushes were `held` (None: their handles completed)
            acks = [(None, "held")] * kept + [(h, "held") for h in waiting.pop("held", [])]
        for group in owed:
            for msg in group:
                msg.meta.pop("pull", None)  # NOTE: the pulls d owed are asked again below
                handle = [acks.pop(0)] if msg.meta.get("ack") and acks else []
                self._split(d, msg, handle)
        for op, reply in (("pull", "params"), ("done", "bye")):
            for h in waiting.pop(reply, []):  # NOTE: a route's: asked of its successors only
                for n, a in enumerate(sorted(index.values()) if s != d else []):
                    self._put(a, Message(op, {"have": -1} if op == "pull" else {}),
                              self._share([(h, reply)], n))
                if s == d:
                    self._split(d, Message(op, {"have": -1} if op == "pull" else {}),
                                [(h, reply)])
        for h in waiting.pop("welcome", []):  # NOTE: a worker still attaching when s died: its
            h.finish_one()  # routes welcome it instead, and frames wait for that (waiting_welcome)
        self._requeue(s, d, sorted(index.values()))
        host = self.hosts.get(s, (d, d))[1]
        what = (f"server {d} {self.why.get(d, 'died')}" if s == d else
                f"server {d} died (it handed keys to a joiner and served the rest)" if host == d
                else f"the route of server {d} on server {host} died with its host")
        print(f"[ps worker{w.rank}] {what}; its keys are served by "
              + ", ".join(f"server {by} ({sum(o == by for o in owner.values())} keys, version "
                          f"{rows[by]['version']})" for by in sorted(index))
              + f"; sent again {sum(len(g) for g in owed)} push frames"
              + (f" ({kept} pushes it had said held)" if w.held_acks else ""), flush=True)

    def _requeue(self, s: int, d: int, new: list[int]) -> None:
        """Route s died before it welcomed this worker: the frames that waited for its
        welcome (never sent, so not in `unacked`) go to d's routes now (its pushes split by
        key, its pulls and dones to the routes `new` that replaced s)."""
        for msg, replies in self.waiting_welcome.pop(s, []):
            if msg.op == "push":
                self._split(d, msg, replies)
                continue
            for n, a in enumerate(new):
                self._put(a, Message(msg.op, {"have": -1} if msg.op == "pull" else {}),
                          self._share(replies, n))

    def version(self, s: int, versions: list[int]) -> None:
        """Route s got parameters: a dead server's version is the oldest of its routes'."""
        for d, keys in self.routes.items():
            if s in keys.values():
                self.w.set_version(d, min(versions[a] for a in set(keys.values())))

    def close(self) -> None:
        if self._link is not None:
            self._link.close()
