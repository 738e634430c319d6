"""Re-replication after a takeover (ps/recopy.py): which chains a death leaves short, who
extends each and who gets the new copy; the manager's record of it (ps/membership.py).

Every server computes the moves alone, so they must follow from the plan and the dead
set only: each key whose chain held the dead server gets one new copy, on a live server
that holds none, from the server whose process holds the short chain's tail; two routes
(which both speak as the dead server) never feed one server. The manager makes each
reported copy one ring version and an event, kept across its restart.
"""

import pytest

from disttrain.ps.membership import Membership, Refused
from disttrain.ps.placement import plan_keys
from disttrain.ps.recopy import moves

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
    with pytest.raises(Refused, match="reports a copy held by server 2"):
        m.recopied(0, [ROW])
    m.save(str(tmp_path / "m.json"))
    again = Membership.from_json((tmp_path / "m.json").read_text(), now=0.0)
    assert again.copies == [ROW] and again.version == v + 1
    assert not again.recopied(2, [ROW]) and again.version == v + 1  # reports after a restart
