"""A join with replicas >= 2 whose old owner X dies after the tails' cut, before it handed
its keys over (ps/join_faults.py), on the real wire: 2 servers at r = 2 and 3 at r = 3, so
every old owner's moved chains hold X. The first live copy of X's chains takes X's keys
over from its copy (bitwise X's values and momentum at its death); each live tail ends its
copy to the joiner with X's final marker; the other old owner keeps its keys; the joiner
drops every copy it took, stops waiting for the owners, and its loop ends; the live
servers' next Sync round is acknowledged without the joiner or X. `broken_owners` is
checked on its own: an owner none of whose moved chains holds the dead server goes on.
"""

import threading

import pytest
import torch
import zmq

from disttrain.ps.frame import Message
from disttrain.ps.join_faults import broken_owners
from disttrain.ps.join_route import JoinRoutes
from disttrain.ps.join_tails import tail_pairs
from disttrain.ps.placement import plan_keys
from disttrain.ps.policy import Sync
from disttrain.ps.takeover import first_live
from tests.unit.test_ps_join_head import _hello, _same
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


class _Killed(Exception):
    """Ends a server's loop as a SIGKILL would: its sockets close, nothing more is sent."""


def _die() -> None:
    raise _Killed


def _serving(server) -> None:
    try:
        server.serve()
    except _Killed:
        pass


def test_an_owner_goes_on_only_if_none_of_its_moved_chains_holds_the_dead_server():
    spec = [(f"t{i}", 40 + 7 * i, 4) for i in range(24)]
    for n, r in [(3, 2), (4, 2), (5, 3)]:
        plan = plan_keys(spec, n, chunk_bytes=CHUNK)
        pairs = tail_pairs(spec, plan, n, r, CHUNK)
        for d in range(n):
            broken = broken_owners(pairs, plan, r, {d})
            for x, _ in pairs:
                holds = any(d in plan.indices(k, r) for o, t in pairs if o == x
                            for k in pairs[(o, t)])
                assert (x in broken) == holds, (n, r, d, x)
            assert all(x in broken for x, _ in pairs if x == d)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n,r", [(2, 2), (3, 3)])
def test_an_owner_dead_after_the_cut_is_taken_over_and_the_joiner_drops_its_copies(n, r):
    torch.manual_seed(2)
    init = {name: torch.randn(size) for name, size in INIT.items()}
    plan, servers, beats, watches, y, intakes = _job(init, n, r)
    ybeat = _Ring()
    ybeat.copied, ybeat.heads = [], []
    joins = JoinRoutes(y, ybeat, intakes, plan, init, Sync(), OPT, KEY, host="127.0.0.1",
                       chunk_bytes=CHUNK)
    threads = [threading.Thread(target=_serving, args=(s,), daemon=True) for s in [*servers, y]]
    for t in threads:
        t.start()
    ctx = zmq.Context()
    links = _links(ctx, servers, plan, r)
    grads = {(w, c, ch.key): torch.randn(ch.numel) for w in (0, 1) for c in range(3)
             for chunks in plan for ch in chunks}
    assert _round(links, plan, grads, 0) == ["ack"] * 2 * n
    ring = _ring(5, "joining", y.address, accepting=True, n=n)
    for row in ring["servers"][:n]:
        row["address"] = servers[row["server"]].address
    for b in [*beats, ybeat]:
        b.ring = ring
    _wait("the joiner never installed the moved ranges",
          lambda: all(i.stats is not None for i in intakes.values()))
    assert _round(links, plan, grads, 1) == ["ack"] * 2 * n
    x = 0  # NOTE: killed after the cut, before the ring lists the joiner's installs
    servers[x].watch = _die
    threads[x].join(10)
    assert not threads[x].is_alive()
    dead = dict(ring, version=6, servers=[dict(row, state="dead") if row["server"] == x
                                          else row for row in ring["servers"]])
    for b in [*beats, ybeat]:
        b.ring = dead
    _wait("the joiner never dropped the owners", lambda: joins.skipped == set(joins.owners))
    threads[n].join(20)
    assert not threads[n].is_alive(), "the joiner's loop did not end"
    assert not joins.started and not joins.routes
    for (o, t), intake in intakes.items():
        assert not set(intake.chunks) & set(y.chain.params), (o, t)  # the joiner forgot them
        if t != x:  # a live tail ended its copy: Y left the chain, X's final went to Y
            assert (o, t) in y.chain.finals and watches[t].ended >= {o}
            assert all(servers[t].chain.hop[k] is None and n not in servers[t].chain.chains[k]
                       for k in intake.chunks)
    assert all(watches[o].hand is False for o in joins.owners if o != x)  # they keep theirs
    mine = [c.key for c in plan[x]]
    for c in range(1, n):  # X's keys: served by the first live copy, X's state bitwise
        keys = [k for k in mine if first_live(plan.indices(k, r), {x}) == c]
        routes = [ro for ro, _, _ in watches[c].inner.take.routes if ro.index == x]
        assert bool(keys) == bool(routes)
        for route in routes:
            assert sorted(route.keys) == sorted(keys)
            for k in keys:
                assert _same(route.params[k], route.optimizer, servers[x].params[k],
                             servers[x].optimizer)
            for w in (0, 1):
                link = _hello(ctx, route.address, w, x, route.keys, r)
                assert _read(link).op == "welcome"
                link.send(Message("done", {}))
                assert _read(link).op == "bye"
                link.close()
    live = {(w, i): link for (w, i), link in links.items() if i != x}
    assert _round(live, plan, grads, 2) == ["ack"] * len(live)  # no wait for X nor the joiner
    for link in live.values():
        link.send(Message("done", {}))
        assert _read(link).op == "bye"
    for t in threads[:n]:
        t.join(20)
        assert not t.is_alive(), "a live server did not end"
    for link in links.values():
        link.close()
    ctx.term()
