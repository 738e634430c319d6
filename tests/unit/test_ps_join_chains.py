"""Where the copies live when a server joins a job with replicas >= 2 (ps/join_chains.py):
the moves every party computes, pure. The join itself with replicas >= 2 is refused
(tests/unit/test_ps_join.py); these are the moves it is designed on."""

import pytest

from disttrain.ps.join_chains import chains_after, extensions, join_moves
from disttrain.ps.join_moves import joined_owners
from disttrain.ps.membership import Membership
from disttrain.ps.placement import place, plan_keys
from tests.unit.test_ps_join import MIXED, MLP

CHUNK = 4 << 20


@pytest.mark.parametrize("params", [MLP, MIXED], ids=["mlp", "few-large-many-small"])
@pytest.mark.parametrize("servers,replicas", [(2, 2), (3, 2), (3, 3), (5, 2), (8, 3)])
def test_the_joiner_replaces_the_head_of_the_keys_it_takes_and_the_copies_stay(
        params, servers, replicas):
    plan, new = plan_keys(params, servers, chunk_bytes=CHUNK), servers
    moves = join_moves(params, plan, new, replicas, CHUNK)
    before = {c.key: plan.indices(c.key, replicas) for chunks in plan for c in chunks}
    after = chains_after(plan, replicas, moves)
    assert set(after) == set(before)
    moved = {m.key: m for m in moves}
    for k, chain in after.items():
        assert len(chain) == len(set(chain)) == replicas  # r distinct copies when done
        if k not in moved:
            assert chain == before[k]  # a chain whose owner stays is not touched
            continue
        m = moved[k]
        assert m.before == tuple(before[k]) and m.tail == before[k][-1]
        assert chain == [new, *before[k][1:]]  # the joiner heads it, the copies stay
        assert new not in m.before  # so while it moves the chain holds r + 1 copies
    sizes = place(params, [f"server{i}" for i in range(servers + 1)]).sizes
    total, nbytes = sum(sizes.values()), sum(sizes[k] for k in moved)
    assert 0 < nbytes <= 2 * total / (servers + 1)  # the r = 1 join's bytes, sent once
    groups = extensions(moves)
    assert sorted(k for ks in groups.values() for k in ks) == sorted(moved)
    for (x, tail), keys in groups.items():
        assert all(moved[k].before[0] == x and moved[k].tail == tail for k in keys)


@pytest.mark.parametrize("params", [MLP, MIXED], ids=["mlp", "few-large-many-small"])
@pytest.mark.parametrize("servers", [2, 3, 4])
def test_with_one_copy_the_moves_are_the_r1_join(params, servers):
    plan = plan_keys(params, servers, chunk_bytes=CHUNK)
    moves = join_moves(params, plan, servers, 1, CHUNK)
    want = [k for x in range(servers) for k, o in joined_owners(
        params, servers, servers, x, [c.key for c in plan[x]], CHUNK).items() if o == servers]
    assert [m.key for m in moves] == want
    assert all(m.tail == m.before[0] and m.after == (servers,) for m in moves)


def test_a_replicas_or_index_the_job_cannot_have_is_refused_naming_the_fix():
    plan = plan_keys(MLP, 2, chunk_bytes=CHUNK)
    with pytest.raises(ValueError, match="replicas=3 with 2 servers launched"):
        join_moves(MLP, plan, 2, 3, CHUNK)
    with pytest.raises(ValueError, match="server 1 is one of the 2 servers launched.*e.g. 2"):
        join_moves(MLP, plan, 1, 2, CHUNK)


def test_a_join_with_replicas_is_taken_by_the_manager():
    m = Membership()
    m.register(0, "ipc://s0", "fp", 2, [["a", 400, [0, 1]]], 0.0)
    m.register(1, "ipc://s1", "fp", 2, [["a", 400, [0, 1]]], 0.0)
    assert m.join(2, "ipc://s2", "fp", ring=2, now=0.0)
    assert m.version == 3 and m.members[2].state == "joining"
