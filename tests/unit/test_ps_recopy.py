"""Re-replication after a takeover (ps/recopy.py): which chains a death leaves short, who
extends each and who gets the new copy; the manager's record of it (ps/membership.py).

Every server computes the moves alone, so they must follow from the plan and the dead
set only: each key whose chain held the dead server gets one new copy, on a live server
that holds none, from the server whose process holds the short chain's tail; two routes
(which both speak as the dead server) never feed one server. The manager makes each
reported copy one ring version and an event, kept across its restart. A new copy that
gets the state before its own heartbeat told it of the death holds it until it knows.
"""

import tempfile
import threading
import time

import pytest
import torch
import zmq

from disttrain.ps.frame import Message
from disttrain.ps.membership import Membership, Refused
from disttrain.ps.membership_file import from_json, save
from disttrain.ps.placement import plan_keys
from disttrain.ps.policy import Sync
from disttrain.ps.recopy import moves
from disttrain.ps.replica import Replicas
from disttrain.ps.server import Server
from disttrain.ps.takeover import Takeover
from disttrain.ps.transport import WorkerLink
from tests.unit.test_ps_replica import read_reply
from tests.unit.test_ps_takeover import _Ring

MODEL = [("emb", 5000, 4), ("w1", 3000, 4), ("b1", 30, 4), ("w2", 900, 4), ("b2", 4, 4)]


def _chains(plan, r):
    return {c.key: [int(s.removeprefix("server")) for s in plan.chain(c.key, r)]
            for cs in plan for c in cs}


@pytest.mark.parametrize("servers,r", [(3, 2), (4, 2), (5, 2), (4, 3), (6, 3)])
def test_every_short_chain_gets_one_copy_on_a_server_without_one(servers, r):
    plan = plan_keys(MODEL, servers, chunk_bytes=2048)
    chains = _chains(plan, r)
    for d in range(servers):
        got = moves(plan, r, {d}, d)
        short = {k for k, ch in chains.items() if d in ch}
        assert {m.key for m in got} <= short and len({m.key for m in got}) == len(got)
        if servers == 3 and r == 2:
            assert {m.key for m in got} == short  # three servers: always a third one
        assert {k for k in short if chains[k][0] != d} <= {m.key for m in got}  # only a
        # route's keys may find every candidate taken by another route
        routes = {}
        for m in got:
            ch = chains[m.key]
            if ch[0] == d:  # the route: speaks as d, hosted by the first live copy
                assert m.chain == (d,) and m.host == ch[1]
                assert routes.setdefault(m.target, m.host) == m.host, "two routes feed one"
            else:
                assert m.chain == tuple(ch[:ch.index(d)]) and m.host == m.chain[-1]
            assert m.target != d and m.target not in (m.host, *m.chain)
            ring = [int(s.removeprefix("server")) for s in plan.chain(m.key, servers)]
            assert m.target in ring and ring.index(m.target) > 0


def test_nothing_to_copy_with_one_replica_two_servers_or_a_second_death():
    assert moves(plan_keys(MODEL, 3, chunk_bytes=2048), 1, {0}, 0) == []
    assert moves(plan_keys(MODEL, 2, chunk_bytes=2048), 2, {1}, 1) == []  # no third server
    assert moves(plan_keys(MODEL, 4, chunk_bytes=2048), 2, {0, 1}, 1) == []


ROW = {"server": 1, "by": 0, "to": 2, "keys": 4, "bytes": 4096, "version": 7}


def test_a_copy_made_again_is_one_version_and_an_event_kept_across_a_restart(tmp_path):
    m = Membership()
    for i in range(3):
        m.register(i, f"ipc://s{i}", "fp", 3, [], 0.0)
    v = m.version
    assert m.recopied(2, [ROW]) and m.version == v + 1
    assert m.events[-1] == (f"ring version {v + 1}: server 2 holds a copy of 4 keys (0.00 MB) "
                            "of server 1 again, from server 0 at version 7: the range has its "
                            "replicas again")
    assert not m.recopied(2, [ROW]) and m.version == v + 1  # every report repeats it
    with pytest.raises(Refused, match="reports a copy held by server 2: a server reports only"):
        m.recopied(0, [ROW])
    save(m, str(tmp_path / "m.json"))
    again = from_json((tmp_path / "m.json").read_text(), now=0.0)
    assert again.copies == [ROW] and again.version == v + 1
    assert not again.recopied(2, [ROW]) and again.version == v + 1  # reports after a restart


# ---- a new copy on the real wire ----------------------------------------------------------
KEY, CHUNK = bytes(range(32)), 256


def _opt(p):
    return torch.optim.SGD(p, lr=0.1, momentum=0.9)


class NewCopy:
    """Server y of a 3-server replicas=2 job, live on a thread with its takeover watch; the
    other servers' addresses answer nothing; `ring` plays its heartbeat's answers."""

    def __init__(self, route: bool):
        torch.manual_seed(0)
        self.init = {"w": torch.randn(2048)}
        self.plan = plan = plan_keys([("w", 2048, 4)], 3, chunk_bytes=CHUNK)
        self.d, m = next((d, m) for d in range(3) for m in moves(plan, 2, {d}, d)
                         if (m.chain == (d,)) == route)
        self.host, y = m.host, m.target
        self.keys = [n.key for n in moves(plan, 2, {self.d}, self.d)
                     if (n.chain, n.host, n.target) == (m.chain, m.host, y)]
        self.server = Server(y, plan[y], self.init, Sync(), _opt, [0], KEY, timeout=60,
                             chunk_bytes=CHUNK)
        self.server.chain = Replicas(y, 1, plan, 2, self.init, _opt, Sync(), self.server.ep,
                                     KEY, timeout=60, chunk_bytes=CHUNK)
        self.ctx, folder = zmq.Context(), tempfile.mkdtemp()
        self.ctx.setsockopt(zmq.LINGER, 0)
        self.at = {j: f"ipc://{folder}/s{j}" for j in set(range(3)) - {y}}
        self.quiet = [self.ctx.socket(zmq.ROUTER) for _ in self.at]
        for sock, address in zip(self.quiet, self.at.values()):
            sock.bind(address)
        self.server.chain.connect(self.at)
        self.beat = _Ring()
        self.take = Takeover(self.server, self.beat, plan, self.init, Sync(), _opt, KEY,
                             host="127.0.0.1", chunk_bytes=CHUNK)
        self.failure = None
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        try:
            self.server.serve()
        except Exception as e:  # noqa: BLE001 - the test reads it
            self.failure = e

    def link(self, who: int) -> WorkerLink:
        """A predecessor's link (worker id 1 + server `who`), welcomed with no keys."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.connect(self.server.address)
        link = WorkerLink(sock, KEY, 1 + who, self.server.index)
        link.send(Message("hello", {"keys": [], "policy": "Sync()", "replicas": 2}))
        assert read_reply(link).op == "welcome"  # a link with no keys yet: welcomed
        return link

    def ring(self, version: int, dead: set[int]) -> None:
        self.beat.ring = {"version": version, "servers": [
            {"server": j, "state": "dead" if j in dead else "alive",
             "address": self.at.get(j, self.server.address)} for j in range(3)]}

    def close(self, *links) -> None:
        for sock in [*links, *self.quiet]:
            sock.close()
        self.ctx.term()


def _transfer(link, origin: int, keys: list[str], val: dict, parts=None) -> None:
    for i, k in enumerate(keys[:parts]):
        meta = {"origin": origin, "version": 4, "part": i, "parts": len(keys), "fields": []}
        if i + 1 == len(keys):
            meta["clocks"] = [{"worker": 0, "clock": 3, "keys": keys}]
        link.send(Message("transfer", meta, [k], [val[k]]))


@pytest.mark.timeout(60)
def test_state_that_comes_before_the_death_is_known_waits_then_installs():
    """Server y is the new copy of keys whose chain was [x, d]. x's transfer reaches y
    before y's heartbeat told it d died: y holds the frames (no answer, nothing
    installed); once its ring marks d dead it installs them, commits each frame, and
    reports the copy for the manager."""
    job = NewCopy(route=False)
    x, y, server = job.host, job.server.index, job.server
    tail = job.link(x)
    val = {k: torch.randn(64) for k in job.keys}
    _transfer(tail, x, job.keys, val)
    with pytest.raises(TimeoutError):
        read_reply(tail, timeout=1.0)  # held: y does not know yet that d died
    assert not any(k in server.chain.params for k in job.keys)
    job.ring(3, {job.d})
    assert [read_reply(tail, timeout=10).meta for _ in job.keys] == [
        {"frame": i + 1} for i in range(len(job.keys))]
    assert all(torch.equal(server.chain.params[k].detach(), val[k]) for k in job.keys)
    assert server.chain.clocks[x][0] == (3, set(job.keys))
    end = time.monotonic() + 10
    while not job.beat.__dict__.get("copied"):
        assert time.monotonic() < end, "the copy was never reported"
        time.sleep(0.05)
    assert job.beat.copied[0] == {"server": x, "by": x, "to": y, "keys": len(job.keys),
                                  "bytes": 256 * len(job.keys), "version": 4}
    assert job.take.recopy.early == {} and job.failure is None
    job.close(tail)


@pytest.mark.timeout(60)
def test_a_route_host_that_dies_mid_copy_is_named_by_the_new_copy():
    """Server d died; the route d@s sends its range's state to y and s dies after the
    first part: no live server holds those keys whole. y stops with an error naming s
    (and its peers hear it), instead of serving half a copy or waiting."""
    job = NewCopy(route=True)
    assert len(job.keys) >= 2, job.keys
    job.ring(3, {job.d})
    route = job.link(job.d)  # NOTE: a route speaks as the dead server d
    val = {k: torch.randn(64) for k in job.keys}
    _transfer(route, job.d, job.keys, val, parts=1)
    assert read_reply(route, timeout=10).meta == {"frame": 1}
    job.ring(4, {job.d, job.host})
    reply = read_reply(route, timeout=10)
    assert reply.op == "error" and f"server {job.host} died" in reply.meta["message"], reply
    end = time.monotonic() + 10
    while job.failure is None:
        assert time.monotonic() < end, "y went on"
        time.sleep(0.05)
    assert f"server {job.host} died" in str(job.failure)
    assert not any(k in job.server.chain.params for k in job.keys)
    job.close(route)
