"""A join with replicas >= 2, step 3 (ps/join_head.py), on the real wire: after the tails
copied the moved ranges to the joiner (join_tails.py), each old owner hands them over
between two Sync rounds: its workers' old sessions are answered `moved` (a push on one is
not applied), a new session naming only the kept keys is served, the `handed` marker
reaches every copy of the moved keys (the joiner last) with the owner's state of them
bitwise, and the owner goes on heading its kept keys (their copies follow bitwise).
Step 4 (join_route.py): the moved keys' copies but the joiner's then follow the joiner's
route under its own id: a bare link with that id standing in for it ("stand-in"), or the
route itself, serving the workers a Sync round ("route"), until its final marker.
"""

import threading
from types import SimpleNamespace

import pytest
import torch
import zmq

from disttrain.ps.frame import Message
from disttrain.ps.join_head import HeadHandover, follow_handed, hand_over, route_id
from disttrain.ps.join_route import JoinRoutes
from disttrain.ps.manager import _answer
from disttrain.ps.membership import Membership
from disttrain.ps.placement import plan_keys
from disttrain.ps.policy import Sync
from disttrain.ps.replica import Replicas
from disttrain.ps.schema import check
from disttrain.ps.server import Server
from disttrain.ps.transport import WorkerLink
from tests.unit.test_ps_join_tails import (
    CHUNK,
    INIT,
    KEY,
    OPT,
    _job,
    _links,
    _read,
    _ring,
    _round,
    _wait,
)
from tests.unit.test_ps_takeover import _Ring


def _hello(ctx, address: str, w: int, i: int, keys: list[str], r: int) -> WorkerLink:
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    link = WorkerLink(sock, KEY, w, i)
    link.send(Message("hello", {"keys": keys, "policy": "Sync()", "replicas": r}))
    return link


def _same(a_param, a_opt, b_param, b_opt) -> bool:
    return torch.equal(a_param, b_param) and torch.equal(
        a_opt.state[a_param]["momentum_buffer"], b_opt.state[b_param]["momentum_buffer"])


def _route_feeds_the_copies(ctx, plan, servers, y, moved, state, n: int, r: int) -> None:
    """Each moved range's copies now follow the joiner's route (id n + 1 + x, its link
    W + id): one update from it reaches every copy but the joiner's (the tail no longer
    forwards to it), each stepping as one SGD step from x's state; then its final marker."""
    for x, ks in moved.items():
        route, firsts = route_id(n, x), {plan.indices(k, r)[1] for k in ks}
        for c1 in sorted(firsts):
            keys = [k for k in ks if plan.indices(k, r)[1] == c1]
            for k in keys:
                assert servers[c1].chain.chains[k] == [route, *plan.indices(k, r)[1:]]
                assert servers[plan.indices(k, r)[-1]].chain.hop[k] is None  # the tail
            link = _hello(ctx, servers[c1].address, 2 + route, c1, keys, r)
            assert _read(link).op == "welcome"
            grads = [torch.randn(servers[c1].chain.params[k].numel(),
                                 dtype=servers[c1].chain.params[k].dtype) for k in keys]
            meta = {"origin": route, "version": 9, "lr": 1.0, "final": 0}
            link.send(Message("replicate", meta, keys, grads))
            assert _read(link).op == "commit"  # NOTE: every later copy has it
            for k, g in zip(keys, grads):
                p = torch.nn.Parameter(state[(x, k)][0].clone())
                ref = torch.optim.SGD([p], lr=0.1, momentum=0.9)
                ref.state[p]["momentum_buffer"] = state[(x, k)][1].clone()
                p.grad = g
                ref.step()
                for c in plan.indices(k, r)[1:]:
                    ch = servers[c].chain
                    assert _same(ch.params[k], ch.optimizer, p, ref), (k, c)
                assert torch.equal(y.chain.params[k], state[(x, k)][0])  # NOTE: not forwarded
            link.send(Message("replicate", {**meta, "final": 1}))
            assert _read(link).op == "commit"
            link.close()


def _the_joiner_serves(ctx, plan, servers, y, joins, beat, moved, links, grads, n: int,
                       r: int) -> None:
    """The joiner serves each old owner's handed keys as a route (join_route.py), listed
    in its heartbeat's `adopted` rows: the workers' sessions to it (as server x, the moved
    keys) get a Sync round acknowledged once every copy c1..T applied it, each equal
    bitwise to the route's values and momentum."""
    routes = {route.index: route for route, _, _ in joins.routes}
    for row in beat.adopted:
        x = row["server"]
        assert row["by"] == n and row["address"] == routes[x].address
        assert routes[x].keys == [c.key for c in plan[x] if c.key in moved[x]]
        for w in (0, 1):
            links[(w, n + 1 + x)] = _hello(ctx, row["address"], w, x, routes[x].keys, r)
            assert _read(links[(w, n + 1 + x)]).op == "welcome"
    # the chains the routes head, as the manager records them (join_status.py): the joiner
    # in the old owner's place, the copies as they were, r of them
    assert sorted((h["owner"], h["key"], tuple(h["chain"])) for h in beat.heads) == sorted(
        (x, k, (n, *plan.indices(k, r)[1:])) for x in routes for k in routes[x].keys)
    sizes = {k: p.numel() * p.element_size() for ro in routes.values()
             for k, p in ro.params.items()}
    assert all(h["bytes"] == sizes[h["key"]] for h in beat.heads)
    check(Message("report", {"worker": 0, "server": n, "ring": 6, "version": 0, "pushes": 0,
                             "heads": beat.heads}), "manager")  # NOTE: raises if malformed
    sent = []
    for (w, i), link in links.items():
        s = servers[i] if i < n else routes[i - n - 1]
        link.send(Message("push", {"clock": 3, "version": s.policy.version, "ack": 1}, s.keys,
                          [grads[(w, 2, k)] for k in s.keys]))
        sent.append(link)
    assert [_read(link).op for link in sent] == ["ack"] * len(sent)
    for x, route in routes.items():
        assert route.policy.version == y.chain.version[x] + 1 and route.chain.index == n + 1 + x
        for k in route.keys:
            assert k not in y.chain.params  # NOTE: the joiner's copy is the route's now
            for c in plan.indices(k, r)[1:]:
                ch = servers[c].chain
                assert _same(ch.params[k], ch.optimizer, route.params[k], route.optimizer)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16],
                         ids=["f32", "f64", "bf16"])  # NOTE: never cast, never lowered
@pytest.mark.parametrize("with_route", [False, True], ids=["stand-in", "route"])
@pytest.mark.parametrize("n,r", [(2, 2), (3, 3)])
def test_the_old_owner_hands_the_moved_ranges_over_and_heads_its_kept_keys(n, r, with_route,
                                                                           dtype):
    torch.manual_seed(0)
    init = {name: torch.randn(size, dtype=dtype) for name, size in INIT.items()}
    plan, servers, beats, watches, y, intakes = _job(init, n, r)
    threads = [threading.Thread(target=s.serve, daemon=True) for s in [*servers, y]]
    for t in threads:
        t.start()
    ctx = zmq.Context()
    links = _links(ctx, servers, plan, r)
    grads = {(w, c, ch.key): torch.randn(ch.numel, dtype=dtype) for w in (0, 1)
             for c in range(3) for chunks in plan for ch in chunks}
    assert _round(links, plan, grads, 0) == ["ack"] * 2 * n
    if with_route:  # the joiner's watch: reports its installs, serves the handed keys
        ybeat = _Ring()
        ybeat.copied, ybeat.heads = [], []
        ybeat.ring = _ring(5, "joining", y.address, accepting=True, n=n)
        for row in ybeat.ring["servers"][:n]:
            row["address"] = servers[row["server"]].address
        joins = JoinRoutes(y, ybeat, intakes, plan, init, Sync(), OPT, KEY,
                           host="127.0.0.1", chunk_bytes=CHUNK)
    for b in beats:
        b.ring = _ring(5, "joining", y.address, accepting=True, n=n)
    _wait("the joiner never installed the moved ranges",
          lambda: all(i.stats is not None for i in intakes.values()))
    assert _round(links, plan, grads, 1) == ["ack"] * 2 * n
    moved = {x: sorted(k for (o, _), i in intakes.items() if o == x for k in i.chunks)
             for x, _ in intakes}
    state = {(x, k): (servers[x].params[k].detach().clone(), servers[x].optimizer.state[
        servers[x].params[k]]["momentum_buffer"].clone()) for x, ks in moved.items() for k in ks}
    versions = {x: servers[x].policy.version for x in moved}
    if with_route:  # NOTE: each old owner hands over once the ring lists the installs
        _wait("the joiner never reported its installs", lambda: len(ybeat.copied) == len(
            intakes))
        assert all(w.hand is None for w in watches)
        for b in beats:
            b.ring = dict(_ring(6, "joining", y.address, accepting=True, n=n),
                          copies=ybeat.copied)
        _wait("an old owner never started its hand-over",
              lambda: all(watches[x].hand is not None for x in moved))
        hands = {x: watches[x].hand for x in moved}
    else:
        hands = {x: HeadHandover(servers[x], ks, 6) for x, ks in moved.items()}
    _wait("an old owner never handed over", lambda: all(h.stats for h in hands.values()))
    for x in moved:
        kept = [c.key for c in plan[x] if c.key not in moved[x]]
        assert servers[x].keys == kept and len(servers[x].optimizer.param_groups[0]["params"]
                                               ) == len(kept)
        for w in (0, 1):
            old = links[(w, x)]
            assert _read(old).op == "moved"  # NOTE: at the hand-over, unasked
            keys = [c.key for c in plan[x]]
            old.send(Message("push", {"clock": 2, "version": 2, "ack": 1}, keys,
                             [grads[(w, 2, k)] for k in keys]))
            assert _read(old).op == "moved" and servers[x].policy.version == versions[x]
            stale = _hello(ctx, servers[x].address, w, x, keys, r)
            assert _read(stale).op == "error"  # NOTE: the handed keys are not served here
            stale.close()
            mixed = _hello(ctx, servers[x].address, w, x, [*kept, moved[x][0]], r)
            reply = _read(mixed)  # NOTE: kept and handed keys: refused, naming the worker
            assert reply.op == "error" and f"worker {w} expects" in reply.meta["message"]
            mixed.close()
            links[(w, x)] = _hello(ctx, servers[x].address, w, x, kept, r)
            assert _read(links[(w, x)]).op == "welcome"
            old.close()
    for x, ks in moved.items():  # every copy of the moved keys, the joiner last, has x's state
        _wait("the handed marker never reached the joiner", lambda x=x: x in y.chain.handed)
        for k in ks:
            for c in [*plan.indices(k, r)[1:], n]:
                chain = (servers[c] if c < n else y).chain
                assert k in chain.handed[x]
                held = chain  # NOTE: the joiner's copy, or the route made of it
                if c == n and with_route:
                    _wait("no route", lambda x=x: x in {ro.index for ro, _, _ in joins.routes})
                    held = next(ro for ro, _, _ in joins.routes if ro.index == x)
                buf = held.optimizer.state[held.params[k]]["momentum_buffer"]
                assert held.params[k].dtype == buf.dtype == dtype, (k, c)  # never lowered
                assert torch.equal(held.params[k], state[(x, k)][0]) and torch.equal(
                    buf, state[(x, k)][1])
    plan_kept = [[c for c in chunks if c.key not in moved.get(i, [])]
                 for i, chunks in enumerate(plan)]
    assert _round(links, plan_kept, grads, 2) == ["ack"] * 2 * n
    for x in moved:  # the kept keys' copies follow their head bitwise
        for k in servers[x].keys:
            for c in plan.indices(k, r)[1:]:
                ch = servers[c].chain
                assert _same(ch.params[k], ch.optimizer, servers[x].params[k],
                             servers[x].optimizer)
    if with_route:
        _wait("the joiner never served the handed keys", lambda: len(joins.routes) == len(moved))
        _the_joiner_serves(ctx, plan, servers, y, joins, ybeat, moved, links, grads, n, r)
    else:
        _route_feeds_the_copies(ctx, plan, servers, y, moved, state, n, r)
    for link in links.values():
        link.send(Message("done", {}))
        assert _read(link).op == "bye"
    for t in threads[:n]:
        t.join(20)
        assert not t.is_alive(), "a server waited for a head's final on handed keys"
    if with_route:
        rows = joins.finish(20)  # NOTE: raises if a route did not end
        assert sorted(row["server"] for row in rows) == sorted(moved) and all(
            row["stats"]["keys"] == len(moved[row["server"]]) for row in rows)
    else:
        y.takes = SimpleNamespace(started=set(), skipped=set(), intakes={})  # ends its loop
    threads[n].join(10)
    assert not threads[n].is_alive(), "the joiner's loop did not end"
    for link in links.values():
        link.close()
    ctx.term()


def test_a_hand_over_of_keys_the_server_does_not_head_or_of_all_its_keys_is_refused():
    s = SimpleNamespace(index=0, keys=["a", "b"], chain=None)
    with pytest.raises(ValueError, match="does not head"):
        hand_over(s, ["c"], 6)
    with pytest.raises(ValueError, match="keep no key"):
        hand_over(s, ["a", "b"], 6)


def _pump(server, link) -> Message:
    """Run server's receive side on this thread until `link` has a reply; the reply."""
    for _ in range(500):
        if server.ep.sock.poll(10) and (got := server.ep.recv()) is not None:
            server._handle(*got)
        if link.sock.poll(0):
            return _read(link)
    raise AssertionError("no reply")


@pytest.mark.timeout(60)
def test_a_handed_marker_for_keys_the_copy_does_not_take_from_that_link_is_refused():
    torch.manual_seed(2)
    init = {name: torch.randn(size) for name, size in INIT.items()}
    spec = [(name, t.numel(), 4) for name, t in init.items()]
    plan = plan_keys(spec, 2, chunk_bytes=CHUNK)
    s = Server(1, plan[1], init, Sync(), OPT, [0, 1], KEY, timeout=60)
    s.chain = Replicas(1, 2, plan, 2, init, OPT, Sync(), s.ep, KEY, timeout=60)
    follow_handed(s.chain, 2)
    ctx = zmq.Context()
    mine = list(s.chain.expect[2])  # server 0's keys copied here, on its link (id W + 0)
    link = _hello(ctx, s.address, 2, 1, mine, 2)
    assert _pump(s, link).op == "welcome"
    meta = {"origin": 0, "version": 1, "lr": 1.0, "final": 0}
    for bad in (["nope"], [plan[1][0].key], []):  # unknown, headed by server 1, none
        link.send(Message("replicate", {**meta, "handed": bad}))
        reply = _pump(s, link)
        assert reply.op == "error" and "handed marker" in reply.meta["message"], reply.meta
    assert s.ep.rejected["schema:replicate.handed"] == 3 and not s.chain.handed
    assert s.chain.chains[mine[0]][0] == 0 and s.chain.received[2] == 0  # nothing changed
    link.send(Message("replicate", {**meta, "handed": mine[:1]}))
    assert _pump(s, link).meta["frame"] == 1  # committed: this copy is the tail
    assert s.chain.handed[0] == {mine[0]} and s.chain.chains[mine[0]] == [route_id(2, 0), 1]
    assert list(s.chain.expect[2 + route_id(2, 0)]) == mine[:1]  # the route's link feeds it
    link.close()
    s.close()
    ctx.term()


def test_the_manager_lists_a_joiners_installs_in_the_ring_for_the_old_owners():
    """The joiner reports each installed range as a `copied` row; the ring lists it under
    `copies` (what starts each old owner's hand-over: join_tails.py) with an event."""
    m = Membership()
    for i in range(2):  # NOTE: the manager checks a row against the chains registered
        m.register(i, f"ipc://s{i}", "fp", 2, [[f"{i}.w#{j}", 4, [i, 1 - i]] for j in range(3)],
                   0.0)
    m.join(2, "ipc://y", "fp", m.version, 0.0)
    row = {"server": 0, "by": 1, "to": 2, "keys": 3, "bytes": 4096, "version": 7}
    beat = {"server": 2, "ring": m.version, "version": 0, "pushes": 0, "final": 0,
            "accepting": 2, "drained": 0, "copied": [row]}
    ring = _answer(m, Message("report", beat), 0.0, {})
    assert ring.op == "ring" and ring.meta["copies"] == [row], ring.meta
    check(Message("ring", ring.meta), "worker")
    assert m.events[-1].endswith("server 2 holds a copy of 3 keys (0.00 MB) of server 0, from "
                                 "server 1 at version 7: a join: handed over next"), m.events
