"""Cluster descriptions and the alpha-beta model: pure functions, no namespaces."""

import pytest

from disttrain.cluster.spec import Cluster, format_rate, parse_rate
from disttrain.comm.cost import Links, choose_algorithm, predict


def test_rates_parse_as_tc_writes_them():
    assert parse_rate("1gbit") == 10**9 and parse_rate("10Gbit") == 10**10
    assert parse_rate("100mbit") == 10**8 and format_rate(2.5e9) == "2.5gbit"
    with pytest.raises(ValueError, match="1gbit"):
        parse_rate("fast")


@pytest.mark.parametrize("kwargs, match", [
    ({"name": "Bad_Name"}, "lowercase letter"),
    ({"topology": "star"}, "switch, full, ring"),
    ({"topology": "full", "switch_bps": 10**9}, "drop --switch"),
    ({"cpus_per_node": 1e6}, "more than this machine"),
    ({"nodes": 1, "topology": "ring"}, "--topology switch"),
])
def test_bad_clusters_say_how_to_fix(kwargs, match):
    args = {"name": "lab", "nodes": 4, "link_bps": 10**9, **kwargs}
    with pytest.raises(ValueError, match=match):
        Cluster(**args)


def test_a_ring_forwards_the_shorter_way_round():
    c = Cluster("lab", 6, 10**9, "ring")
    assert [c.ring_next_hop(0, j) for j in range(1, 6)] == [1, 1, 1, 5, 5]
    assert len(c.links()) == 6 and len(Cluster("lab", 6, 10**9, "full").links()) == 15
    assert len(Cluster("lab", 2, 10**9, "ring").links()) == 1


def test_the_model_matches_the_hand_worked_four_by_two_example():
    links = Links(alpha=1e-4, link_Bps=1e9 / 8, local_alpha=0.0, local_Bps=float("inf"))
    s = 64e6
    assert predict("ring", s, 8, 2, links) == pytest.approx(14 * 1e-4 + 1.75 * s / links.link_Bps)
    assert predict("hierarchical", s, 8, 2, links) == pytest.approx(6 * 1e-4 + 1.5 * s / links.link_Bps)
    assert predict("ring", s, 4, 1, links) == pytest.approx(6 * 1e-4 + 1.5 * s / links.link_Bps)


def test_auto_picks_few_steps_for_small_messages_and_the_bandwidth_optimal_ones_for_large():
    links = Links(alpha=2e-4, link_Bps=1e9 / 8)
    assert choose_algorithm(1024, 8, 1, links) in ("tree", "halving-doubling")
    assert choose_algorithm(64e6, 8, 2, links) == "hierarchical"
    assert choose_algorithm(64e6, 6, 1, links) == "ring"


def test_the_cpu_term_takes_the_slower_of_link_and_pool_and_counts_only_senders():
    pool = Links(alpha=0.0, link_Bps=1e9 / 8, local_alpha=0.0, local_Bps=float("inf"),
                 cpu_Bps=3e9 / 8, cpu_local_Bps=float("inf"), shared_cpu=True)
    s = 64e6
    # 2 nodes: each step one S/2 message per sender, link 1 Gbit/s, pool 3 Gbit/s for 2 senders
    assert predict("ring", s, 2, 1, pool) == pytest.approx(2 * (s / 2) / pool.link_Bps)
    # 8 nodes: 8 senders of S/8 share the pool (8 S/8 / 3 Gbit/s) > one S/8 on the link
    assert predict("ring", s, 8, 1, pool) == pytest.approx(14 * s / pool.cpu_Bps)
    # a tree's level k has only its senders on the pool: 4, 2, 1 of 8 ranks
    expected = 2 * sum(max(s / pool.link_Bps, k * s / pool.cpu_Bps) for k in (4, 2, 1))
    assert predict("tree", s, 8, 1, pool) == pytest.approx(expected)
    # one pool per node (a real cluster): the 8 senders are 1 per node, so the link rules
    assert predict("ring", s, 8, 1, Links(**{**pool.__dict__, "shared_cpu": False})) == pytest.approx(
        14 * (s / 8) / pool.link_Bps)


def test_a_per_sender_step_cost_makes_auto_pick_the_tree_for_small_messages():
    busy = Links(alpha=5e-4, link_Bps=1e9 / 8, step_alpha=2e-4, cpu_Bps=3e9 / 8, shared_cpu=True)
    assert choose_algorithm(64 << 10, 8, 1, busy) == "tree"
    assert choose_algorithm(64 << 10, 16, 2, busy) == "tree"
    assert choose_algorithm(64 << 20, 8, 1, busy) != "tree"
