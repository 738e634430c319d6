"""A join with replicas >= 2, step 2 (ps/join_tails.py), on the real wire: two servers,
each the other's copy (r = 2), and a joiner. Once the ring lists the joiner ready, the
tail of each moved range extends it to the joiner: the joiner's copies then hold the
head's values, momentum and version bitwise after every later Sync round, each push
acknowledged only once the joiner has it, and the head's final marker reaches it. A
joiner marked dead before the hand-over is dropped: the heads' acks stop waiting for it.
"""

import threading
import time
from types import SimpleNamespace

import pytest
import torch
import zmq

from disttrain.ps.frame import Message
from disttrain.ps.handover import Handover
from disttrain.ps.join_chains import join_moves
from disttrain.ps.join_tails import TailJoins, join_intakes, tail_pairs
from disttrain.ps.joiner import _Joiner
from disttrain.ps.placement import plan_keys
from disttrain.ps.policy import Sync
from disttrain.ps.replica import Replicas
from disttrain.ps.server import Server
from disttrain.ps.takeover import Takeover
from disttrain.ps.transport import WorkerLink
from tests.unit.test_ps_manager import KEY
from tests.unit.test_ps_takeover import _link, _read, _Ring

CHUNK = 1 << 20
OPT = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731


@pytest.mark.parametrize("servers,replicas", [(2, 2), (3, 2), (3, 3), (5, 2), (5, 3)])
def test_every_moved_key_is_extended_by_its_tail_once(servers, replicas):
    spec = [(f"t{i}", 40 + 7 * i, 4) for i in range(24)]
    plan = plan_keys(spec, servers, chunk_bytes=CHUNK)
    moves = join_moves(spec, plan, servers, replicas, CHUNK)
    per_tail = [tail_pairs(spec, plan, servers, replicas, CHUNK, tail=t) for t in range(servers)]
    got = sorted(k for pairs in per_tail for keys in pairs.values() for k in keys)
    assert moves and got == sorted(m.key for m in moves)  # each moved key, by one tail
    for t, pairs in enumerate(per_tail):
        for (x, tail), keys in pairs.items():
            assert tail == t != x and all(plan.indices(k, replicas)[::replicas - 1] == [x, t]
                                          for k in keys)


def _ring(version: int, joiner: str, address: str, accepting: bool, n: int = 2) -> dict:
    rows = [{"server": i, "state": "alive", "address": ""} for i in range(n)]
    return {"version": version, "expected": n, "accepting": [[n, n]] if accepting else [],
            "servers": [*rows, {"server": n, "state": joiner, "address": address}]}


def _job(init, n: int = 2, r: int = 2):
    """Servers 0..n-1 (r copies) with their watches, a joiner (n) with its intakes."""
    spec = [(name, t.numel(), t.element_size()) for name, t in init.items()]
    plan = plan_keys(spec, n, chunk_bytes=CHUNK)
    servers, beats, watches = [], [], []
    for i in range(n):
        s = Server(i, plan[i], init, Sync(), OPT, [0, 1], KEY, timeout=60)
        s.chain = Replicas(i, 2, plan, r, init, OPT, Sync(), s.ep, KEY, timeout=60)
        servers.append(s)
    for i, s in enumerate(servers):
        s.chain.connect({j: o.address for j, o in enumerate(servers) if j != i})
        beats.append(_Ring())
        take = Handover(Takeover(s, beats[i], plan, init, Sync(), OPT, KEY, host="127.0.0.1",
                                 chunk_bytes=CHUNK))
        watches.append(TailJoins(take, s, beats[i], spec, plan, init, OPT, KEY,
                                 chunk_bytes=CHUNK))
    y = _Joiner(n, [], init, Sync(), OPT, [0, 1], KEY, timeout=60)
    intakes = join_intakes(y, spec, plan, init, OPT, r, secret=KEY, chunk_bytes=CHUNK)
    return plan, servers, beats, watches, y, intakes


def _links(ctx, servers, plan, r: int) -> dict:
    """(worker, server) -> a worker's link, welcomed."""
    out = {}
    for w in (0, 1):
        for i, s in enumerate(servers):
            sock = ctx.socket(zmq.DEALER)
            sock.connect(s.address)
            out[(w, i)] = link = WorkerLink(sock, KEY, w, i)
            link.send(Message("hello", {"keys": [c.key for c in plan[i]], "policy": "Sync()",
                                        "replicas": r}))
            assert _read(link).op == "welcome"
    return out


def _round(links, plan, grads, clock: int) -> list[str]:
    """Every worker pushes round `clock` to both servers; the replies' ops."""
    for (w, i), link in links.items():
        keys = [c.key for c in plan[i]]
        link.send(Message("push", {"clock": clock, "version": clock, "ack": 1}, keys,
                          [grads[(w, clock, k)] for k in keys]))
    return [_read(link).op for link in links.values()]


def _wait(what, cond, limit: float = 20.0) -> None:
    end = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.02)


INIT = {f"t{i}": 40 + 7 * i for i in range(8)}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n,r", [(2, 2), (3, 3)])
def test_the_tails_copy_the_moved_ranges_to_the_joiner_which_then_follows_bitwise(n, r):
    torch.manual_seed(0)
    init = {name: torch.randn(size) for name, size in INIT.items()}
    plan, servers, beats, watches, y, intakes = _job(init, n, r)
    assert len({x for x, _ in intakes}) == 2, intakes  # two old owners give keys here
    threads = [threading.Thread(target=s.serve, daemon=True) for s in [*servers, y]]
    for t in threads:
        t.start()
    ctx = zmq.Context()
    links = _links(ctx, servers, plan, r)
    grads = {(w, c, ch.key): torch.randn(ch.numel) for w in (0, 1) for c in range(3)
             for chunks in plan for ch in chunks}
    assert _round(links, plan, grads, 0) == ["ack"] * 2 * n
    for b in beats:
        b.ring = _ring(5, "joining", y.address, accepting=True, n=n)
    _wait("the joiner never installed the moved ranges",
          lambda: all(i.stats is not None for i in intakes.values()))
    for c in (1, 2):
        assert _round(links, plan, grads, c) == ["ack"] * 2 * n
        for x, _ in intakes:  # NOTE: acknowledged, so on the joiner too
            assert y.chain.version[x] == c + 1
    for (x, tail), intake in intakes.items():
        assert intake.stats["version"] == 1 and watches[tail].exts[x].stats["keys"] == len(
            intake.chunks)
        head = servers[x]
        for k in intake.chunks:
            assert y.chain.chains[k] == [*plan.indices(k, r), n] and tail == y.chain.chains[k][-2]
            mine, theirs = y.chain.params[k], head.params[k]
            assert torch.equal(mine, theirs)
            assert torch.equal(y.chain.optimizer.state[mine]["momentum_buffer"],
                               head.optimizer.state[theirs]["momentum_buffer"])
    for link in links.values():
        link.send(Message("done", {}))
        assert _read(link).op == "bye"
    for t in threads[:n]:
        t.join(20)
        assert not t.is_alive(), "a server did not end once the joiner committed"
    assert {(x, tail) for x, tail in intakes} <= y.chain.finals  # every head's final came
    y.takes = SimpleNamespace(started=set(), skipped=set(), intakes={})  # ends its loop
    threads[n].join(10)
    for link in links.values():
        link.close()
    ctx.term()


@pytest.mark.timeout(90)
def test_a_joiner_marked_dead_before_it_served_is_dropped_and_acks_go_on():
    torch.manual_seed(1)
    init = {n: torch.randn(size) for n, size in INIT.items()}
    plan, servers, beats, watches, y, intakes = _job(init)
    threads = [threading.Thread(target=s.serve, daemon=True) for s in servers]
    for t in threads:  # NOTE: the joiner's loop never runs: as if killed once ready
        t.start()
    ctx = zmq.Context()
    links = {(w, i): _link(ctx, servers[i].address, w, i, [c.key for c in plan[i]])
             for w in (0, 1) for i in (0, 1)}
    grads = {(w, c, ch.key): torch.randn(ch.numel) for w in (0, 1) for c in range(2)
             for chunks in plan for ch in chunks}
    for b in beats:
        b.ring = _ring(5, "joining", y.address, accepting=True)
    _wait("the tails never cut", lambda: all(w.exts or w.done for w in watches))
    for (w, i), link in links.items():
        keys = [c.key for c in plan[i]]
        link.send(Message("push", {"clock": 0, "version": 0, "ack": 1}, keys,
                          [grads[(w, 0, k)] for k in keys]))
    assert not any(link.sock.poll(300) for link in links.values())  # waiting for the joiner
    for b in beats:
        b.ring = _ring(6, "dead", y.address, accepting=False)
    assert [_read(link).op for link in links.values()] == ["ack"] * 4
    for (x, tail) in intakes:
        assert all(servers[tail].chain.hop[k] is None for k in intakes[(x, tail)].chunks)
        assert 2 in servers[tail].chain.dead and all(w.done for w in watches)
    assert _round(links, plan, grads, 1) == ["ack"] * 4
    for link in links.values():
        link.send(Message("done", {}))
        assert _read(link).op == "bye"
    for t in threads:
        t.join(20)
        assert not t.is_alive(), "a server waited for the dead joiner"
    y.close()
    for link in links.values():
        link.close()
    ctx.term()
