"""A drain with replicas >= 2 (ps/handover.py), on the real wire: two servers, each the
other's copy. Server 1 is marked leaving after a Sync round: it tells its workers
`moved`, sends its final marker, and ends once its copy committed everything; its copy
on server 0 then holds its values, momentum and version bitwise. Marked left, server 0
serves server 1's keys as a route, and the next round ends as one process stepping the
same rounds. A worker holding the ring from before the drain re-routes the drained
server's keys to the first live copy of each key's chain, as for a death.
"""

import threading
import time

import pytest
import torch
import zmq

from disttrain.ps.frame import Message
from disttrain.ps.handover import Handover
from disttrain.ps.manager_link import SERVER_PARTY
from disttrain.ps.placement import plan_keys
from disttrain.ps.policy import Sync
from disttrain.ps.replica import Replicas
from disttrain.ps.reroute import Routes
from disttrain.ps.server import Server
from disttrain.ps.takeover import Takeover
from tests.unit.test_ps_manager import KEY, Live, _register
from tests.unit.test_ps_manager import secret_env as secret_env  # a fixture
from tests.unit.test_ps_takeover import _link, _read, _Ring


def _ring(version: int, state1: str) -> dict:
    return {"version": version, "servers": [{"server": 0, "state": "alive"},
                                            {"server": 1, "state": state1}]}


@pytest.mark.timeout(60)
def test_a_drained_server_hands_its_keys_to_its_copy_which_serves_them_bitwise():
    torch.manual_seed(0)
    init = {"w": torch.randn(64), "x": torch.randn(4), "y": torch.randn(4)}
    plan = plan_keys([(n, t.numel(), 4) for n, t in init.items()], 2)
    assert [[c.key for c in s] for s in plan] == [["w"], ["x", "y"]]
    opt = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    servers, beats, takes = [], [], []
    for i in (0, 1):
        s = Server(i, plan[i], init, Sync(), opt, [0, 1], KEY, timeout=60)
        s.chain = Replicas(i, 2, plan, 2, init, opt, Sync(), s.ep, KEY, timeout=60)
        servers.append(s)
    for i, s in enumerate(servers):
        s.chain.connect({1 - i: servers[1 - i].address})
        beats.append(_Ring())
        takes.append(Takeover(s, beats[i], plan, init, Sync(), opt, KEY, host="127.0.0.1",
                              chunk_bytes=1 << 20))
    leaving = Handover(takes[1])
    threads = [threading.Thread(target=s.serve, daemon=True) for s in servers]
    for t in threads:
        t.start()
    ctx = zmq.Context()
    grads = {(w, c, k): torch.randn(4) for w in (0, 1) for c in (0, 1) for k in "xy"}
    links = [_link(ctx, servers[1].address, w, 1, ["x", "y"]) for w in (0, 1)]
    for w, link in enumerate(links):
        link.send(Message("push", {"clock": 0, "version": 0, "ack": 1}, ["x", "y"],
                          [grads[(w, 0, "x")], grads[(w, 0, "y")]]))
    assert [_read(link).op for link in links] == ["ack", "ack"]  # on the copy too
    beats[1].ring = _ring(3, "leaving")
    assert [_read(link).meta for link in links] == [{"ring": 3}, {"ring": 3}]  # `moved`
    threads[1].join(10)
    assert not threads[1].is_alive(), "the leaving server did not end once its copy committed"
    assert leaving.finish(1.0) == [] and beats[1].drained
    copy = servers[0].chain
    assert copy.version[1] == 1 and (1, 1) in copy.finals  # every update, then its final
    assert all(torch.equal(copy.params[k], servers[1].params[k]) for k in "xy")
    beats[0].ring = _ring(4, "left")  # the manager marked it left: the copy takes over
    end = time.monotonic() + 20
    while not beats[0].adopted:
        assert time.monotonic() < end, "server 0 never took over the drained server's keys"
        time.sleep(0.05)
    row = beats[0].adopted[0]
    assert (row["server"], row["by"], row["keys"], row["version"]) == (1, 0, 2, 1)
    routes = [_link(ctx, row["address"], w, 1, ["x", "y"]) for w in (0, 1)]
    for w, link in enumerate(routes):
        link.send(Message("push", {"clock": 1, "version": 1, "ack": 1, "pull": 1}, ["x", "y"],
                          [grads[(w, 1, "x")], grads[(w, 1, "y")]]))
    answers = []
    for link in routes:
        while (a := _read(link)).op == "ack":
            pass
        answers.append(a)
    assert all(a.op == "params" and a.meta["version"] == 2 for a in answers)
    ref = {k: torch.nn.Parameter(init[k].clone()) for k in "xy"}  # one process, same rounds
    ref_opt = opt(list(ref.values()))
    for c in (0, 1):
        for k in "xy":
            ref[k].grad = (grads[(0, c, k)] * 1.0).add_(grads[(1, c, k)], alpha=1.0).div_(2)
        ref_opt.step()
    got = dict(zip(answers[0].keys, answers[0].tensors))
    assert all(torch.equal(got[k], ref[k].detach()) for k in "xy"), (got, ref)
    for link in [*links, *routes]:
        link.close()
    ctx.term()


class _Worker:
    """What Routes reads and calls of a worker that re-routes nothing it owes."""

    rank, chunk_bytes, held_acks = 0, 400, False

    def __init__(self, servers: int, params: dict):
        self.addresses = [f"ipc://s{i}" for i in range(servers)]
        self.params = params

    def open_route(self, d: int, address: str, keys: list[str], r: int) -> int:
        self.addresses.append(address)
        return len(self.addresses) - 1

    def owed(self, s: int) -> dict:
        return {}


@pytest.mark.timeout(30)
def test_a_worker_with_the_old_ring_finds_a_drained_servers_keys_on_their_copies(
        tmp_path, secret_env):
    """4 servers, server 2 drained: one of its keys has another server in the bounded-load
    placement without it than the next copy of its chain; the worker must follow the
    chains (the copies serve the keys), not the placement."""
    plan, v = plan_keys([("w", 3000, 4)], 4, chunk_bytes=400), 2
    live = Live(str(tmp_path / "m.json"), timeout=30)
    try:
        links = [live.link(SERVER_PARTY + i) for i in range(4)]
        for i, link in enumerate(links):
            _register(link, i, [(c.key, c.numel * 4, plan.indices(c.key, 2)) for c in plan[i]],
                      expected=4)
        worker = _Worker(4, {"w": torch.zeros(3000)})
        routes = Routes(worker, plan, 2, live.address)
        assert routes.silent(v, quiet=5.0, beat=1.0) is None  # alive: nothing to do
        operator = live.link(1 << 30)
        operator.request("lookup")
        drain = operator.request("leave", server=v).meta["version"]
        heirs = {plan.indices(c.key, 2)[1] for c in plan[v]}  # each key's next copy
        links[v].request("report", server=v, version=5, pushes=9, drained=1)  # LEFT
        for j in sorted(heirs):
            links[j].request("report", server=j, version=5, pushes=9, adopted=[{
                "server": v, "by": j, "address": f"ipc://route{v}@{j}", "keys": 1, "bytes": 4,
                "version": 5, "after": 0.1}])
        routes.told(v, drain)  # it answered `moved`: the worker asks (every 0.5 s)
        end = time.monotonic() + 5
        while v not in routes.routes:
            assert time.monotonic() < end, "the worker did not re-route the drained server's keys"
            assert routes.silent(v, quiet=0.0, beat=1.0) is None
            time.sleep(0.1)
        for c in plan[v]:  # every key to the route on the next copy of its chain
            where = worker.addresses[routes.routes[v][c.key]]
            assert where == f"ipc://route{v}@{plan.indices(c.key, 2)[1]}", (c.key, where)
        routes.close()
    finally:
        live.close()
