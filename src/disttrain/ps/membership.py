"""The server group's membership and ring version: the server manager's state, pure.

The manager (manager.py) owns one `Membership`: which servers exist, where they listen,
what they hold, whether they are alive, and the ring's `version`. Every change of
membership (a server registers, joins, leaves, is marked dead, comes back at a new
address) is exactly one new version, so every party moves through the versions in order;
a party holding an older version is told so on its next request and gets the whole
current ring (the state is small: sending it whole is simpler than diffs). Heartbeats
update load counters and never change the version. Changes that would lose data or mix
jobs are refused with `Refused`, which names the fix. A change asked for on an older
version than the current one (`join`, `leave`) is refused with `Stale`: compare and set,
so two operators never act on two different rings.

The state survives a restart of its process: membership_file.py writes it as JSON
atomically and reads it back.

Pure: no sockets, no clocks (callers pass `now`), no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Member", "Membership", "Refused", "Stale", "MANAGER_INDEX", "ALIVE", "DEAD",
           "LEFT", "EXITED", "LEAVING", "JOINING", "FORMAT"]

MANAGER_INDEX = 2**31 - 1  # the manager's own "server index" on the wire; never a ring member
ALIVE, DEAD, LEFT, EXITED = "alive", "dead", "left", "exited"
LEAVING = "leaving"  # drained with keys: they move to the other servers first (move.py)
JOINING = "joining"  # added to a running job: keys move to it (join_moves.py)
FORMAT = 1  # of the saved file; bump when its meaning changes


class Refused(ValueError):
    """A membership change or a registration the manager does not make; says why and the fix."""


class Stale(Refused):
    """A change asked for on an older ring version than the current one."""


@dataclass
class Member:
    """One server of the ring, as the manager knows it."""

    server: int
    """its index (ring.py names it f"server{index}")."""
    address: str
    """where workers reach it (`ipc://...` or `tcp://host:port`)."""
    state: str = ALIVE
    """ALIVE, LEAVING (drained, its keys moving), DEAD (missed heartbeats), LEFT (drained)
    or EXITED (its job ended)."""
    attempt: int = 0
    """the launch attempt it registered in (`disttrain run --max-restarts` restarts)."""
    shard: list = field(default_factory=list)
    """[key, bytes, chain] of each key it heads; chain: the servers holding copies, owner
    first. As registered; a joiner's: the moved keys its routes head (join_status.py)."""
    version: int = 0
    """its parameter version at its last heartbeat (updates applied)."""
    pushes: int = 0
    """push frames it received, at its last heartbeat."""
    rate: float = 0.0
    """push frames per second between its last two heartbeats."""
    beat: float = 0.0
    """the caller's clock at its last heartbeat or registration (not saved)."""
    pid: int = 0
    """its process id (0: not given); a server on the manager's host whose process is gone
    is dead at once, not after the whole timeout (`expire`)."""
    accepting: int = -1
    """the leaving server whose keys it is ready to take (move.py), -1: none."""

    def row(self, fingerprint: str, now: float) -> dict:
        """This member as a `state` message row (schema.STATE_ROW)."""
        return {"server": self.server, "address": self.address, "state": self.state,
                "attempt": self.attempt, "fingerprint": fingerprint, "keys": len(self.shard),
                "bytes": sum(n for _, n, _ in self.shard), "version": self.version,
                "pushes": self.pushes, "rate": float(self.rate),
                "silent": float(max(0.0, now - self.beat))}


@dataclass
class Membership:
    """The ring's members and version; every method says whether it changes the version."""

    expected: int = 0
    """servers the job was launched with (0: not known until the first registration)."""
    version: int = 0
    """the ring version: 0 before anyone registered, +1 per membership change."""
    fingerprint: str = ""
    """the model's keys and the policy every server must serve ("" until the first one)."""
    members: dict[int, Member] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    """membership changes in order, one line each (what the status and the report show)."""
    takeovers: list[dict] = field(default_factory=list)
    """a dead server's keys a copy serves now (schema.TAKEOVER_ROW): the `ring` carries them,
    so a worker finds where a dead server's keys went (takeover.py)."""
    copies: list[dict] = field(default_factory=list)
    """ranges copied again after a takeover (schema.COPY_ROW, recopy.py)."""

    # ---- changes ------------------------------------------------------------------------
    def register(self, server: int, address: str, fingerprint: str, expected: int,
                 shard: list, now: float, attempt: int = 0, pid: int = 0) -> bool:
        """A launched server says where it listens and what it holds; True if that is a new
        version (first registration, or a new address or launch attempt: a restarted
        server). Raises Refused."""
        self._same_job(server, fingerprint, expected)
        if server >= self.expected and server not in self.members:
            raise Refused(f"server {server} is not one of the {self.expected} servers this "
                          f"job was launched with (0..{self.expected - 1}); a server added to "
                          "a running job joins instead (`disttrain ps add-server`)")
        m = self.members.get(server)
        if m is not None and (m.address, m.attempt, m.state) == (address, attempt, ALIVE):
            m.beat, m.shard, m.pid = now, [list(r) for r in shard], pid
            return False
        was = "registered" if m is None else f"came back ({m.state} at {m.address})"
        self.members[server] = Member(server, address, ALIVE, attempt,
                                      [list(r) for r in shard], beat=now, pid=pid)
        self.takeovers = [t for t in self.takeovers if server not in (t["server"], t["by"])]
        return self.change(f"server {server} {was} at {address}")

    def join(self, server: int, address: str, fingerprint: str, ring: int, now: float) -> bool:
        """A server added to a running job: JOINING while its keys move to it (join_moves.py).
        Raises Stale (ring is not current) or Refused (another model, an index in use)."""
        self._current(ring, "join")
        self._same_job(server, fingerprint, self.expected)
        if server == MANAGER_INDEX or server in self.members or server < self.expected:
            raise Refused(f"server {server} is already a member of ring version "
                          f"{self.version}: pick an index not in use, e.g. "
                          f"{max([*self.members, self.expected - 1]) + 1}")
        self._joinable(server)
        self.members[server] = Member(server, address, JOINING, beat=now)
        return self.change(f"server {server} joined at {address}: the keys the placement "
                            f"on {len(self.members)} servers gives it move to it (joining)")

    def _joinable(self, server: int) -> None:
        """Refused: one server (its keys are whole tensors), a second change, a death."""
        busy = [(i, m.state) for i, m in sorted(self.members.items()) if i >= self.expected
                or m.state in (LEAVING, JOINING) or m.state == LEFT and m.shard]
        dead = [i for i, m in sorted(self.members.items()) if m.state == DEAD]
        why = ("this job has one server, whose keys are whole tensors (two cut them otherwise):"
               " start it with --servers 2 or more" if self.expected < 2 else
               f"server {busy[0][0]} is {busy[0][1]}: one membership change that moves keys "
               "per job (a join or a drain)" if busy else
               f"server {dead[0]} is dead: a join after a death is not built (the join's moves "
               "follow the launch plan's chains, a takeover changed them)" if dead else "")
        if why:
            raise Refused(f"server {server} cannot join: {why}; restart the job with the "
                          "servers it needs")

    def leave(self, server: int, ring: int) -> bool:
        """Drain `server` from the ring. Refused when it is the manager, not a member, or
        holds the last live copy of a key. Raises Stale when ring is not current."""
        if server == MANAGER_INDEX:
            raise Refused("the manager is not a server of the ring and cannot be drained: "
                          "servers and workers learn the ring from it; stop the job instead")
        self._current(ring, "leave")
        m = self.members.get(server)
        joined = [i for i in self.members if i >= self.expected]
        if joined and m is not None and (m.shard or server in joined):
            raise Refused(f"server {joined[0]} joined this job and took keys: one membership "
                          "change that moves keys per job; restart the job to drain one")
        if m is None or m.state != ALIVE:
            raise Refused(f"server {server} is not an alive member of ring version "
                          f"{self.version} (members: {self._names()})")
        last = self.only_copies(server)
        others = sorted(i for i, x in self.members.items() if i != server and x.state == ALIVE)
        moving = [i for i, x in self.members.items() if x.state == LEAVING]
        moved = [i for i, x in self.members.items() if x.state == LEFT and x.shard
                 and all(len(c) == 1 for _, _, c in x.shard)]  # NOTE: drained with key moves
        copied = any(len(c) > 1 for _, _, c in m.shard)  # NOTE: replicas >= 2
        if last and (not others or moving or moved or copied):
            nbytes = sum(n for key, n, _chain in m.shard if key in last)
            why = ("no other server is alive to take them" if not others else
                   f"server {moving[0]} is still leaving: drain one server at a time"
                   if moving else f"server {moved[0]}'s keys moved already: a second drain "
                   "that moves keys is not built yet (the moved keys are served as routes)"
                   if moved else "its other copies are on servers no longer alive (replicas"
                   " >= 2: the copies serve a drained server's keys, none is moved)")
            raise Refused(
                f"server {server} holds the last live copy of {len(last)} keys "
                f"({nbytes / 1e6:.2f} MB, e.g. {last[0]!r}) and {why}; draining it would lose "
                "them. Wait and try again, or start the job with replicas >= 2")
        if copied:  # NOTE: replicas >= 2: a planned failover to its copies (handover.py)
            return self._hand_over(m, moving)
        if last:  # NOTE: replicas=1: its keys move to the others, then it leaves (move.py)
            m.state = LEAVING
            return self.change(f"server {server} at {m.address} is leaving: its {len(last)} "
                                f"keys move to the placement without it (servers {others})")
        m.state = LEFT
        return self.change(f"server {server} at {m.address} left (drained)")

    def _hand_over(self, m: Member, moving: list[int]) -> bool:
        """Drain m (replicas >= 2, every key with a live copy elsewhere: handover.py)."""
        gone = moving + [i for i, x in self.members.items() if x.state in (DEAD, LEFT)]
        if gone:
            raise Refused(f"server {m.server} cannot be drained: server {gone[0]} is "
                          f"{self.members[gone[0]].state}, and with replicas >= 2 a drain comes "
                          "first or not at all (the manager's last-copy check reads the chains "
                          "servers registered, not the copies a takeover made again): wait for "
                          "the job to end, restart it")
        m.state = LEAVING
        return self.change(f"server {m.server} at {m.address} is leaving: its {len(m.shard)} "
                            "keys are served by their next live copies once it handed over "
                            "(replicas >= 2)")

    def beat(self, server: int, version: int, pushes: int, final: bool, now: float,
             accepting: int = -1, drained: bool = False) -> bool:
        """A server's heartbeat (load counters); final: its job ended (no version change);
        accepting: the leaving server whose keys it is ready to take; drained: a
        leaving server handed all its keys over (LEFT: a new version). True if the version
        changed (a server marked dead that beats again is back). Raises Refused for a
        server that never registered."""
        m = self.members.get(server)
        if m is None:
            raise Refused(f"server {server} is not registered with this manager (members: "
                          f"{self._names()}): register first")
        if now > m.beat and pushes >= m.pushes:
            m.rate = (pushes - m.pushes) / (now - m.beat)
        m.version, m.pushes, m.beat, m.accepting = version, pushes, now, accepting
        if drained and m.state == LEAVING:
            m.state = LEFT
            return self.change(f"server {server} at {m.address} left: " + (
                "its copies serve its keys" if m.shard[0][2][1:] else "its keys moved"))
        if final and m.state == LEFT:
            return False
        if final:
            unfinished = m.state == LEAVING
            m.state = EXITED
            self.events.append(f"server {server} exited (its job ended) at ring version "
                               f"{self.version}" + (": its drain had not finished, its keys "
                                                    "stayed on it to the end" if unfinished else ""))
            return False
        if m.state == DEAD:
            m.state = ALIVE
            return self.change(f"server {server} at {m.address} is heard again")
        return False

    def expire(self, now: float, timeout: float, gone=None, soon: float = 0.0) -> list[str]:
        """Mark dead every alive server silent for more than `timeout` seconds, or for more
        than `soon` s when `gone(member)` says its process no longer exists; one new version
        per server marked. Returns the events (one line each, naming it)."""
        out = []
        for m in sorted(self.members.values(), key=lambda m: m.server):
            silent = now - m.beat
            if m.state not in (ALIVE, LEAVING, JOINING) or silent <= min(timeout, soon or timeout):
                continue
            why = (f"missed its heartbeats for {silent:.1f} s (timeout {timeout:g} s)"
                   if silent > timeout else (f"process {m.pid} is gone (silent {silent:.1f} s)"
                                             if gone is not None and gone(m) else None))
            if why is None:
                continue
            m.state = DEAD
            lost = self.only_copies(m.server)
            self.change(f"server {m.server} at {m.address} {why}: marked dead"
                         + (f"; {len(lost)} keys have no other live copy" if lost else "")
                         + (" on the chains servers registered (not counting copies made "
                            "again)" if lost and self.copies else ""))
            out.append(self.events[-1])
        return out

    def adopt(self, by: int, rows: list[dict], now: float) -> bool:
        """Server `by` serves dead servers' keys now (its report's `adopted` rows); True (a
        new version, an event each) for every row not known yet."""
        new = [dict(r, by=by) for r in rows if not any(  # NOTE: a route of a route: same pair
            (t["server"], t["by"], t["address"]) == (r["server"], by, r["address"])
            for t in self.takeovers)]
        joined = any(i >= self.expected for i in self.members)  # NOTE: X@X, X@Y (join_moves.py)
        for r in new:  # NOTE: every row checked before any is taken
            dead = self.members.get(r["server"])
            if dead is None or dead.state not in (DEAD, LEFT) and not joined or r["by"] != by:
                raise Refused(f"server {by} reports taking over server {r['server']}'s keys, "
                              f"which ring version {self.version} does not mark dead (members: "
                              f"{self._names()}): only a dead server's keys are taken over")
        for r in new:
            dead = self.members[r["server"]]
            self.takeovers.append(r)
            if self.members[by].state == JOINING:  # NOTE: its first route: it serves keys now
                self.members[by].state = ALIVE
            since = (f", {now - dead.beat:.1f} s after its last heartbeat"
                     if dead.state in (DEAD, LEFT) else " (a join moved keys)")
            self.change(f"server {by} took over {r['keys']} keys ({r['bytes'] / 1e6:.2f} MB) "
                         f"of {dead.state} server {r['server']} at version {r['version']}{since}; "
                         f"workers reach them at {r['address']}")
        return bool(new)

    def recopied(self, to: int, rows: list[dict]) -> bool:
        """Server `to` holds a copy again of a range a death left short (its report's
        `copied` rows); True (a new version, an event each) for every row not known yet."""
        for r in rows:  # NOTE: its last report (final) comes after it exited: still its own
            if r["to"] != to or to not in self.members:
                raise Refused(f"server {to} reports a copy held by server {r['to']}: a server "
                              "reports only the copies it holds itself")
        self.copies += (new := [r for r in rows if r not in self.copies])
        for r in new:
            why = ("a join: handed over next", "the range has its replicas again")[to < self.expected]
            self.change(f"server {to} holds a copy of {r['keys']} keys ({r['bytes'] / 1e6:.2f} "
                         f"MB) of server {r['server']}{' again' * (to < self.expected)}, from "
                         f"server {r['by']} at version {r['version']}: {why}")
        return bool(new)

    # ---- views --------------------------------------------------------------------------
    def accepting(self) -> list[list[int]]:
        """[server, leaving server] of every server ready to take a leaving one's keys."""
        return [[i, m.accepting] for i, m in sorted(self.members.items()) if m.accepting >= 0]

    def complete(self) -> bool:
        """Every server the job was launched with has registered and is alive."""
        return self.expected > 0 and all(
            i in self.members and self.members[i].state == ALIVE for i in range(self.expected))

    def ring_rows(self) -> list[dict]:
        """The `ring` message's rows (schema.RING_ROW), by server index."""
        return [{"server": m.server, "address": m.address, "state": m.state,
                 "attempt": m.attempt}
                for _, m in sorted(self.members.items())]

    def only_copies(self, server: int) -> list[str]:
        """Keys `server` holds of which no other alive member holds a copy."""
        others = {i for i, m in self.members.items() if i != server and m.state == ALIVE}
        m = self.members.get(server)
        return [k for k, _, chain in (m.shard if m else []) if not others & set(chain)]

    # ---- internals ----------------------------------------------------------------------
    def _same_job(self, server: int, fingerprint: str, expected: int) -> None:
        if server == MANAGER_INDEX:
            raise Refused(f"server index {MANAGER_INDEX} is the manager's own")
        if self.fingerprint and fingerprint != self.fingerprint:
            raise Refused(f"server {server} serves another model or policy (fingerprint "
                          f"{fingerprint[:16]}, this group's {self.fingerprint[:16]}): build "
                          "the same model and policy on every rank")
        if self.expected and expected != self.expected:
            raise Refused(f"server {server} was launched with {expected} servers, this group "
                          f"with {self.expected}: one manager serves one job's server group")
        self.fingerprint, self.expected = fingerprint, expected

    def _current(self, ring: int, what: str) -> None:
        if ring != self.version:
            raise Stale(f"{what} asked on ring version {ring}, the current one is "
                        f"{self.version}: refresh the ring (lookup) and decide again")

    def change(self, event: str) -> bool:
        """One new ring version, `event` its line (join_status.py records chains with it)."""
        self.version += 1
        self.events.append(f"ring version {self.version}: {event}")
        return True

    def _names(self) -> str:
        return ", ".join(f"{i} ({m.state})" for i, m in sorted(self.members.items())) or "none"
