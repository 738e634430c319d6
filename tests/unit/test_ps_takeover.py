"""The manager's side of a takeover (ps/membership.py, ps/manager.py) and the worker's view.

A server whose process is gone (one on the manager's host: an ipc address and a pid) is
marked dead within the fast bound, not the whole timeout; a server that reports the
dead server's keys it took over (`report.adopted`) is one new ring version, an event
naming who took what, at which version, how long after the dead one's last heartbeat,
kept across a manager restart and carried by every `ring` answer (`takeovers`), where a
worker finds it. A worker whose dead server has no copy (replicas=1, or every copy
dead) is told so at once, naming the server and the fix (ps/reroute.py).
"""

import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch
import zmq

from disttrain.ps.frame import Message
from disttrain.ps.manager import _gone
from disttrain.ps.manager_link import SERVER_PARTY
from disttrain.ps.membership import Membership, Refused
from disttrain.ps.membership_file import from_json, save
from disttrain.ps.placement import plan_keys
from disttrain.ps.policy import Sync
from disttrain.ps.replica import Replicas
from disttrain.ps.reroute import Routes
from disttrain.ps.server import Server
from disttrain.ps.takeover import Takeover
from disttrain.ps.transport import WorkerLink
from tests.unit.test_ps_manager import KEY, Live, _register
from tests.unit.test_ps_manager import secret_env as secret_env  # a fixture
from tests.unit.test_ps_replica import read_reply

SHARD0 = [["a", 400, [0, 1]], ["b", 100, [0, 1]]]
SHARD1 = [["c", 300, [1, 0]]]
ROW = {"server": 1, "by": 0, "address": "ipc://route", "keys": 1, "bytes": 300, "version": 7,
       "after": 0.01}


def _two(pid1: int = 0) -> Membership:
    m = Membership()
    m.register(0, "ipc://s0", "fp", 2, SHARD0, 0.0)
    m.register(1, "ipc://s1", "fp", 2, SHARD1, 0.0, pid=pid1)
    return m


def test_a_server_whose_process_is_gone_is_dead_at_the_fast_bound_not_the_timeout():
    m = _two(pid1=4242)
    m.beat(0, 1, 1, False, now=2.5)
    gone = {0: False, 1: True}
    assert m.expire(now=1.9, timeout=10.0, gone=lambda x: gone[x.server], soon=2.0) == []
    events = m.expire(now=2.1, timeout=10.0, gone=lambda x: gone[x.server], soon=2.0)
    assert events == ["ring version 3: server 1 at ipc://s1 process 4242 is gone (silent 2.1 "
                      "s): marked dead"] and m.members[1].state == "dead"
    assert m.expire(now=9.0, timeout=10.0, gone=lambda x: False, soon=2.0) == []  # alive: waits


def test_a_takeover_is_one_version_an_event_and_part_of_every_ring(tmp_path):
    m = _two()
    with pytest.raises(Refused, match="server 0 reports taking over server 1's keys, which "
                       "ring version 2 does not mark dead"):
        m.adopt(0, [ROW], now=1.0)  # a stale or forged report changes nothing
    assert m.version == 2 and m.takeovers == []
    m.beat(0, 1, 1, False, now=10.5)
    m.expire(now=11.0, timeout=10.0)
    assert m.adopt(0, [ROW], now=12.5) and m.version == 4
    assert m.events[-1] == ("ring version 4: server 0 took over 1 keys (0.00 MB) of dead server "
                            "1 at version 7, 12.5 s after its last heartbeat; workers reach "
                            "them at ipc://route")
    assert not m.adopt(0, [ROW], now=13.0) and m.version == 4  # every report repeats it
    save(m, str(tmp_path / "m.json"))
    again = from_json((tmp_path / "m.json").read_text(), now=0.0)
    assert again.takeovers == [ROW] and again.members[1].pid == 0
    assert m.register(1, "ipc://s1-new", "fp", 2, SHARD1, 20.0) and m.takeovers == []


def test_gone_reads_the_process_table_for_local_servers_only():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        m = _two(pid1=child.pid).members[1]
        assert not _gone(m)
        child.kill()
        child.wait()
        assert _gone(m)
        m.address = "tcp://10.0.0.2:5000"  # another host: its pid means nothing here
        assert not _gone(m)
    finally:
        child.kill()


@pytest.mark.timeout(30)
def test_the_ring_carries_takeovers_to_workers(tmp_path):
    live = Live(str(tmp_path / "m.json"), timeout=0.6)
    try:
        s0, s1 = live.link(SERVER_PARTY), live.link(SERVER_PARTY + 1)
        _register(s0, 0, SHARD0)
        _register(s1, 1, SHARD1)
        deadline = time.monotonic() + 5
        while s0.request("report", server=0, version=3, pushes=1).meta["version"] < 3:
            assert time.monotonic() < deadline, "server 1 never marked dead"
            time.sleep(0.1)
        ring = s0.request("report", server=0, version=3, pushes=1, adopted=[ROW]).meta
        assert ring["version"] == 4 and ring["takeovers"] == [ROW]
        assert live.link(0).request("lookup").meta["takeovers"] == [ROW]
    finally:
        live.close()


class _Worker:  # what Routes reads of a worker before any re-route
    rank, addresses = 0, ["ipc://s0", "ipc://s1"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("replicas,needle", [
    (1, "marks it dead) and with replicas=1 no other server holds its keys: start the job "
        "with replicas >= 2"),
    (2, "every copy of")])
def test_a_worker_is_told_at_once_when_no_copy_can_take_over(tmp_path, secret_env, replicas,
                                                             needle):
    live = Live(str(tmp_path / "m.json"), timeout=0.6)
    try:
        for i, shard in ((0, SHARD0), (1, SHARD1)):
            _register(live.link(SERVER_PARTY + i), i, shard)
        plan = plan_keys([("w", 1000, 4)], 2, chunk_bytes=400)
        routes = Routes(_Worker(), plan, replicas, live.address)
        deadline, text = time.monotonic() + 5, None
        while text is None:  # both servers silent: 1 is marked dead, then 0
            assert time.monotonic() < deadline, "no verdict"
            text = routes.silent(1, quiet=3.0, beat=1.0)
            time.sleep(0.6)
        assert text.startswith("server 1 at ipc://s1 died") and needle in text, text
        routes.close()
    finally:
        live.close()


# ---- a copy takes over, on the real wire ---------------------------------------------------
class _Ring:
    """The heartbeat as Takeover reads it: the newest ring, the rows it reports."""

    def __init__(self):
        self.ring, self.adopted = {"version": 2, "servers": []}, []


def _link(ctx, address: str, who: int, server: int, keys: list[str]) -> WorkerLink:
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    link = WorkerLink(sock, KEY, who, server)
    link.send(Message("hello", {"keys": keys, "policy": "Sync()", "replicas": 2}))
    assert _read(link).op == "welcome"
    return link


def _read(link: WorkerLink) -> Message:
    return read_reply(link, timeout=20.0)


@pytest.mark.timeout(90)
def test_a_copy_takes_over_a_half_forwarded_sync_round_and_applies_no_push_twice():
    """Server 1 heads x and y (copied on server 0). Round 1 reached the copy whole, round
    2 only its x half (server 1 died between two batches of that update). Server 0 takes
    over at version 1: the workers send round 2's pushes again (and worker 0 round 1's
    too, never acknowledged): y gets round 2's mean, x nothing more, round 1 nothing more;
    values and momentum end as one process stepping the same rounds."""
    torch.manual_seed(0)
    init = {"w": torch.randn(64), "x": torch.randn(4), "y": torch.randn(4)}
    plan = plan_keys([(n, t.numel(), 4) for n, t in init.items()], 2)
    assert [[c.key for c in s] for s in plan] == [["w"], ["x", "y"]]
    opt = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    server = Server(0, plan[0], init, Sync(), opt, [0, 1], KEY, timeout=60)
    server.chain = Replicas(0, 2, plan, 2, init, opt, Sync(), server.ep, KEY, timeout=60)
    ctx = zmq.Context()
    dead = ctx.socket(zmq.ROUTER)  # server 1's address: it never answers
    dead_at = f"ipc://{tempfile.mkdtemp()}/s1"
    dead.bind(dead_at)
    server.chain.connect({1: dead_at})
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    grads = {(w, c, k): torch.randn(4) for w in (0, 1) for c in (0, 1) for k in "xy"}
    mean = {(c, k): (grads[(0, c, k)] * 1.0).add_(grads[(1, c, k)], alpha=1.0).div_(2)
            for c in (0, 1) for k in "xy"}
    pred = _link(ctx, server.address, 2 + 1, 0, ["x", "y"])  # server 1's replica link
    for meta, keys in (({"version": 1, "pushes": [[0, 0], [1, 0]]}, ["x", "y"]),
                       ({"version": 2, "pushes": [[0, 1], [1, 1]]}, ["x"])):
        pred.send(Message("replicate", {"origin": 1, "lr": 1.0, "final": 0, **meta}, keys,
                          [mean[(meta["version"] - 1, k)] for k in keys]))
        assert _read(pred).op == "commit"
    beat = _Ring()
    take = Takeover(server, beat, plan, init, Sync(), opt, KEY, host="127.0.0.1",
                    chunk_bytes=1 << 20)
    beat.ring = {"version": 3, "servers": [{"server": 0, "state": "alive"},
                                           {"server": 1, "state": "dead"}]}
    end = time.monotonic() + 20
    while not beat.adopted:
        assert time.monotonic() < end, "server 0 never took over"
        time.sleep(0.05)
    row = beat.adopted[0]
    assert (row["server"], row["by"], row["keys"], row["version"]) == (1, 0, 2, 1)
    workers = [_link(ctx, row["address"], w, 1, ["x", "y"]) for w in (0, 1)]
    workers[0].send(Message("push", {"clock": 0, "version": 0, "ack": 1}, ["x", "y"],
                            [grads[(0, 0, "x")], grads[(0, 0, "y")]]))
    assert _read(workers[0]).op == "ack"  # applied before the takeover: acknowledged only
    for w, link in enumerate(workers):
        link.send(Message("push", {"clock": 1, "version": 1, "ack": 1, "pull": 1}, ["x", "y"],
                          [grads[(w, 1, "x")], grads[(w, 1, "y")]]))
    answers = []
    for link in workers:  # NOTE: the route has no copy: it acks on receipt (or with the params)
        while (a := _read(link)).op == "ack":
            pass
        answers.append(a)
    assert all(a.op == "params" and a.meta["version"] == 2 for a in answers)
    # one process stepping the same rounds: x twice, y once then once more
    ref = {k: torch.nn.Parameter(init[k].clone()) for k in "xy"}
    ref_opt = opt(list(ref.values()))
    for step in ({"x": mean[(0, "x")], "y": mean[(0, "y")]}, {"x": mean[(1, "x")]},
                 {"y": mean[(1, "y")]}):
        for k, g in step.items():
            ref[k].grad = g
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    got = dict(zip(answers[0].keys, answers[0].tensors))
    assert all(torch.equal(got[k], ref[k].detach()) for k in "xy"), (got, ref)
    route = take.routes[0][0]
    assert all(torch.equal(route.optimizer.state[route.params[k]]["momentum_buffer"],
                           ref_opt.state[ref[k]]["momentum_buffer"]) for k in "xy")
    assert route.policy.applied == 2 and route.policy.version == 2
    for link in [*workers, pred]:
        link.close()
    dead.close()
    ctx.term()
