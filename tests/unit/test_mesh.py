"""Mesh coordinate math, checked by hand against the (pp, dp, tp) grid; no processes."""

import itertools

import pytest

from disttrain.mesh import MeshShape


def test_tp_is_innermost_pp_outermost():
    s = MeshShape(pp=2, dp=2, tp=2)
    assert [tuple(s.coords(r).values()) for r in range(8)] == list(
        itertools.product(range(2), range(2), range(2))
    )
    assert s.coords(5) == {"pp": 1, "dp": 0, "tp": 1}


def test_rank_at_inverts_coords():
    s = MeshShape(pp=3, dp=2, tp=4)
    for r in range(s.world_size):
        assert s.rank_at(**s.coords(r)) == r


def test_groups_by_hand():
    s = MeshShape(pp=2, dp=2, tp=2)
    assert s.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert s.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert s.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert s.peers(3, "pp") == [3, 7]


def test_every_rank_in_exactly_one_group_per_axis():
    s = MeshShape(pp=2, dp=3, tp=2)
    for axis in ("pp", "dp", "tp"):
        flat = sorted(r for g in s.groups(axis) for r in g)
        assert flat == list(range(12))
        assert all(len(g) == s.size(axis) for g in s.groups(axis))


def test_wrong_world_size_names_every_factor():
    with pytest.raises(ValueError, match=r"pp\(2\) \* dp\(2\) \* tp\(2\) != world_size\(6\)"):
        MeshShape(pp=2, dp=2, tp=2).check_world_size(6)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_degree_is_rejected(bad):
    with pytest.raises(ValueError, match="tp must be an integer >= 1"):
        MeshShape(tp=bad)


def test_bad_axis_and_rank():
    s = MeshShape(dp=2)
    with pytest.raises(ValueError, match="unknown mesh axis 'ep'"):
        s.groups("ep")
    with pytest.raises(ValueError, match="rank 2 is outside"):
        s.coords(2)
