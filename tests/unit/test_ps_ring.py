"""HashRing: owners are stable, adding/removing one of S servers moves about 1/S of keys."""

import pytest

from disttrain.ps.ring import HashRing, chunk_tensor

KEYS = [f"layer{i}.weight" for i in range(5000)]


def _moved(before: HashRing, after: HashRing) -> float:
    return sum(before.owner(k) != after.owner(k) for k in KEYS) / len(KEYS)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("s", [2, 4, 8])
def test_adding_one_server_moves_about_one_over_s_plus_one(s):
    old = HashRing([f"server{i}" for i in range(s)])
    new = HashRing([f"server{i}" for i in range(s)])
    new.add(f"server{s}")
    frac = _moved(old, new)
    # ideal 1/(S+1): 0.333, 0.2, 0.111; 128 vnodes keep us within ~35% of it
    assert abs(frac - 1 / (s + 1)) < 0.35 / (s + 1), frac
    # only keys that now belong to the new server moved
    assert all(new.owner(k) == f"server{s}" for k in KEYS if old.owner(k) != new.owner(k))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("s", [3, 4, 8])
def test_removing_one_server_moves_only_its_keys(s):
    ring = HashRing([f"server{i}" for i in range(s)])
    before = {k: ring.owner(k) for k in KEYS}
    ring.remove("server1")
    moved = [k for k in KEYS if ring.owner(k) != before[k]]
    assert all(before[k] == "server1" for k in moved)
    assert abs(len(moved) / len(KEYS) - 1 / s) < 0.35 / s


@pytest.mark.timeout(30)
def test_balance_and_load_report():
    ring = HashRing([f"server{i}" for i in range(4)], vnodes=128)
    load = ring.load({k: 100 for k in KEYS})
    assert sum(load.values()) == 100 * len(KEYS)
    share = [v / (100 * len(KEYS)) for v in load.values()]
    assert max(share) < 0.25 * 1.35 and min(share) > 0.25 * 0.65, share
    assert sorted(ring.assign(KEYS)) == sorted(ring.servers)


@pytest.mark.timeout(30)
def test_mod_hashing_would_move_most_keys():
    # the reason for a ring: hash % S moves ~S/(S+1) of keys when S grows by one
    import zlib
    moved = sum(zlib.crc32(k.encode()) % 4 != zlib.crc32(k.encode()) % 5 for k in KEYS)
    assert moved / len(KEYS) > 0.7


@pytest.mark.timeout(30)
def test_same_ring_in_any_order_and_errors():
    a, b = HashRing(["s0", "s1", "s2"]), HashRing(["s2", "s0", "s1"])
    assert all(a.owner(k) == b.owner(k) for k in KEYS[:500])
    with pytest.raises(ValueError, match="already"):
        a.add("s0")
    with pytest.raises(KeyError, match="not on the ring"):
        a.remove("s9")
    with pytest.raises(RuntimeError, match="no servers"):
        HashRing().owner("x")
    with pytest.raises(ValueError, match="vnodes"):
        HashRing(["s0"], vnodes=0)


@pytest.mark.timeout(30)
def test_chunking_big_tensors_spreads_them():
    assert [c.key for c in chunk_tensor("w", 10, 4)] == ["w"]
    chunks = chunk_tensor("emb.weight", 10_000_000, 4, chunk_bytes=4 << 20)
    assert [c.key for c in chunks[:2]] == ["emb.weight#0", "emb.weight#1"]
    assert chunks[0].start == 0 and chunks[-1].stop == 10_000_000
    assert all(a.stop == b.start for a, b in zip(chunks, chunks[1:]))
    assert all(c.numel * 4 <= 4 << 20 for c in chunks)
    ring = HashRing([f"server{i}" for i in range(4)])
    assert len({ring.owner(c.key) for c in chunks}) >= 3
    with pytest.raises(ValueError, match="'#'"):
        chunk_tensor("a#b", 3, 4)
