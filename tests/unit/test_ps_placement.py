"""Placement balances bytes: no server over 1.25x the mean, a membership change moves <= 2/S.

Measured for S = 2..16 on the digits MLP (examples/digits_ps.py), the GPT example's shapes
(examples/gpt_char.py defaults) and a model of a few large and many small tensors.
"""

import functools
import os
import random
import subprocess
import sys

import pytest
import torch

from disttrain.models import GPT, GPTConfig
from disttrain.ps.connect import format_stats
from disttrain.ps.placement import BALANCE, Placement, key_bytes_limit, place, plan_keys
from disttrain.ps.ring import HashRing, chunk_tensor


def _shapes(model):
    return [(n, p.numel(), p.element_size()) for n, p in model.named_parameters()]


def _digits():
    nn = torch.nn
    return _shapes(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                                 nn.Linear(64, 10)))


def _gpt():
    return _shapes(GPT(GPTConfig(vocab_size=128, block_size=64, n_layer=4, n_head=4,
                                 n_embd=64, tie_embeddings=False)))


def _few_large_many_small():
    return ([("embed", 50_000 * 64, 4), ("head", 64 * 50_000, 2)]
            + [(f"norm{i}", 64, 4) for i in range(200)]
            + [(f"proj{i}", 64 * 256, 4) for i in range(10)])


MODELS = {"digits": _digits, "gpt": _gpt, "mixed": _few_large_many_small}


def _names(s, skip=None):
    return [f"server{i}" for i in range(s) if i != skip]


@functools.cache
def _placed(model, s, skip=None):
    return place(MODELS[model](), _names(s, skip))


def _total(model):
    return sum(n * e for _, n, e in MODELS[model]())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("model", MODELS)
def test_no_server_holds_more_than_1_25_times_the_mean_bytes(model):
    for s in range(2, 17):
        load = _placed(model, s).load()
        assert sum(load.values()) == _total(model)
        mean = _total(model) / s
        assert max(load.values()) <= BALANCE * mean, (s, sorted(load.values()))
        assert min(load.values()) > 0, (s, load)  # nobody idle


@pytest.mark.timeout(60)
@pytest.mark.parametrize("model", MODELS)
def test_adding_or_removing_one_server_moves_at_most_two_over_s(model):
    total, worst = _total(model), 0.0
    for s in range(2, 17):
        here = _placed(model, s)
        if s < 16:  # add server{s}: measured against 2/S of the smaller group
            frac = here.moved_bytes(_placed(model, s + 1)) / total
            assert frac <= 2 / s, ("add", s, frac)
            worst = max(worst, frac * s)
        for gone in {0, s // 2, s - 1}:  # remove one of S: 2/S of the larger group
            frac = here.moved_bytes(_placed(model, s, gone)) / total
            assert frac <= 2 / s, ("remove", s, gone, frac)
            assert frac >= here.load()[f"server{gone}"] / total  # its own bytes must move
            worst = max(worst, frac * s)
    assert worst > 0.5  # the measure measures: a change does move about 1/S


@pytest.mark.timeout(60)
def test_the_old_plan_held_4_1_1_0_keys_and_fails_the_cap():
    # the plan before bounded loads: whole tensors under 4 MB, each hashed on its own
    ring = HashRing(_names(4))
    keys = [c for n, k, e in _digits() for c in chunk_tensor(n, k, e)]
    load = ring.load({c.key: c.numel * 4 for c in keys})
    assert sorted(len(v) for v in ring.assign([c.key for c in keys]).values()) == [0, 1, 1, 4]
    assert max(load.values()) > BALANCE * _total("digits") / 4
    new = _placed("digits", 4)
    assert max(new.load().values()) <= BALANCE * _total("digits") / 4
    assert min(len(new.keys(s)) for s in new.servers) > 10


@pytest.mark.timeout(60)
@pytest.mark.parametrize("model", MODELS)
def test_keys_are_contiguous_ranges_no_bigger_than_a_chunk_and_the_same_for_every_s(model):
    params = MODELS[model]()
    keysets = {tuple(sorted(_placed(model, s).chunks)) for s in range(2, 17)}
    assert len(keysets) == 1  # membership never renames keys up to 16 servers
    chunk_bytes = 64 << 10
    p = place(params, _names(5), chunk_bytes=chunk_bytes)
    for name, numel, size in params:
        parts = sorted((c.start, c.stop, c.key) for c in p.chunks.values() if c.name == name)
        assert parts[0][0] == 0 and parts[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
        assert all((stop - start) * size <= max(chunk_bytes, size) for start, stop, _ in parts)
        sizes = {stop - start for start, stop, _ in parts}
        assert max(sizes) - min(sizes) <= 1  # equal ranges, as ps-lite's
        if len(parts) > 1:
            assert [k for _, _, k in parts] == [f"{name}#{i}" for i in range(len(parts))]
    assert key_bytes_limit(_total(model), 5, chunk_bytes) <= chunk_bytes


@pytest.mark.timeout(60)
def test_every_rank_computes_the_same_plan_whatever_the_server_list_order():
    params = _gpt()
    a = place(params, _names(7))
    shuffled = _names(7)
    random.Random(3).shuffle(shuffled)
    b = place(params, shuffled)
    assert all(a.owner(k) == b.owner(k) for k in a.chunks)
    assert plan_keys(params, 7) == a.plan()
    # one server: nothing to balance, whole tensors (as before), the same model cut finer
    # from two servers on; the bytes a change from one to two moves are counted per element
    one = place(params, _names(1))
    assert [len(x) for x in one.plan()] == [len(params)] and len(a.chunks) > 4 * len(params)
    two = place(params, _names(2))
    assert 0 < one.moved_bytes(two) == two.load()["server1"]


@pytest.mark.timeout(60)
def test_chain_is_the_owner_then_the_next_distinct_servers():
    p = _placed("gpt", 6)
    ring = HashRing(_names(6))
    for key in list(p.chunks)[:50]:
        chain = p.chain(key, 3)
        assert chain[0] == p.owner(key) and len(set(chain)) == 3
        assert sorted(p.chain(key, 6)) == _names(6)
        assert p.chain(key, 6)[:3] == chain
        plain = ring.chain(key, 3)
        assert plain[0] == ring.owner(key) and len(set(plain)) == 3
    with pytest.raises(ValueError, match=r"r=7 .*\(6\)"):
        p.chain(key, 7)
    with pytest.raises(ValueError, match=r"r=0 .*\(6\)"):
        ring.chain(key, 0)
    with pytest.raises(KeyError, match="not in this placement"):
        p.owner("nope")


@pytest.mark.timeout(60)
def test_placement_of_plain_sizes_and_errors():
    sizes = {f"k{i}": 100 + i for i in range(400)}
    p = Placement.of_sizes(sizes, _names(8))
    assert sum(p.load().values()) == sum(sizes.values())
    assert max(p.load().values()) <= BALANCE * sum(sizes.values()) / 8
    assert len(p.describe()) == 8 and "x the mean" in p.describe()[0]
    with pytest.raises(ValueError, match="at least one server"):
        Placement.of_sizes(sizes, [])
    with pytest.raises(ValueError, match="distinct"):
        Placement.of_sizes(sizes, ["a", "a"])


@pytest.mark.timeout(60)
def test_the_server_report_line_compares_its_bytes_with_the_mean():
    stats = {"server": 2, "policy": "Sync()", "keys": 30, "bytes": 150_000, "version": 3,
             "applied": 6, "dropped": 0, "lost_workers": [], "staleness": {0: 6}}
    assert "30 keys, 0.15 MB, version 3" in format_stats(stats)
    stats.update(mean_bytes=125_000.0, servers=4)
    assert "30 keys, 0.15 MB (1.20x the mean of 4 servers), version 3" in format_stats(stats)


@pytest.mark.timeout(60)
def test_another_process_with_another_hash_seed_computes_the_same_plan():
    # every rank computes the plan alone: nothing in it may depend on Python's str hash
    params, names = [("emb", 50000, 4), ("w", 3000, 4), ("b", 10, 4)], _names(5)
    code = ("from disttrain.ps.placement import place; "
            f"p = place({params!r}, {names!r}); print(hash('disttrain')); "
            "print(sorted((k, p.owner(k), c.start, c.stop) for k, c in p.chunks.items()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout
    child_hash, child_plan = out.splitlines()
    p = place(params, names)
    assert int(child_hash) != hash("disttrain")  # the two processes really hash apart
    assert child_plan == str(sorted((k, p.owner(k), c.start, c.stop) for k, c in p.chunks.items()))
    assert "emb#" in child_plan
