"""disttrain.data without processes: same indices as torch's sampler, loader epochs and resume."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
import torch.utils.data as tud
from hypothesis import given, settings
from hypothesis import strategies as st

import disttrain.settings
from disttrain.data import DistributedSampler, shard_loader

pytestmark = pytest.mark.timeout(60)


def _torch_indices(n, replicas, rank, shuffle, seed, drop_last, epoch):
    s = tud.DistributedSampler(range(n), replicas, rank, shuffle, seed, drop_last)
    s.set_epoch(epoch)
    return list(s), len(s)


def _ours(n, replicas, rank, shuffle, seed, drop_last, epoch):
    s = DistributedSampler(range(n), replicas, rank, shuffle, seed, drop_last)
    s.set_epoch(epoch)
    return list(s), len(s)


def test_same_indices_as_torch_on_a_grid():
    # Sizes 0..13 cover n < replicas (padding repeats the order several times), n == 0,
    # and every remainder modulo 1..5.
    checked = 0
    for n, replicas, shuffle, drop_last, seed in itertools.product(
        range(14), range(1, 6), (True, False), (True, False), (0, 1, 42, -7)
    ):
        for rank, epoch in itertools.product(range(replicas), range(4)):
            args = (n, replicas, rank, shuffle, seed, drop_last, epoch)
            assert _ours(*args) == _torch_indices(*args), args
            checked += 1
    assert checked == 14 * 15 * 2 * 2 * 4 * 4


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(0, 300),
    replicas=st.integers(1, 9),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    seed=st.integers(-(2**31), 2**40),
    epoch=st.integers(0, 1000),
    data=st.data(),
)
def test_same_indices_as_torch_random(n, replicas, shuffle, drop_last, seed, epoch, data):
    rank = data.draw(st.integers(0, replicas - 1))
    args = (n, replicas, rank, shuffle, seed, drop_last, epoch)
    assert _ours(*args) == _torch_indices(*args)


def test_epochs_reshuffle_and_ranks_partition_the_padded_order():
    a = [list(DistributedSampler(range(10), 3, r)) for r in range(3)]
    union = sorted(sum(a, []))
    assert set(union) == set(range(10)) and len(union) == 12  # 2 padded repeats
    s = DistributedSampler(range(50), 2, 0)
    first = list(s)
    s.set_epoch(1)
    assert list(s) != first
    assert list(s) == list(s)  # no implicit advance: torch semantics


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_replicas": 4, "rank": 4}, r"rank 4 is out of range for num_replicas=4.*\[0, 3\]"),
        ({"num_replicas": 4, "rank": -1}, r"rank -1 is out of range"),
        ({"num_replicas": 0, "rank": 0}, r"num_replicas must be >= 1, got 0"),
        ({"num_replicas": 2.0, "rank": 0}, r"num_replicas must be an int"),
        ({"num_replicas": 2, "rank": 0, "seed": 1.5}, r"seed must be an int"),
    ],
)
def test_sampler_errors(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        DistributedSampler(range(10), **kwargs)


def test_sampler_needs_len_and_defaults_from_runtime(monkeypatch):
    with pytest.raises(TypeError, match="no __len__.*map-style"):
        DistributedSampler(iter(range(3)), 1, 0)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    s = DistributedSampler(range(9), shuffle=False)
    assert (s.rank, s.num_replicas, list(s)) == (2, 3, [2, 5, 8])
    monkeypatch.setenv("DISTTRAIN_SERVERS", "1")  # rank 2 of 3 is now the server
    disttrain.settings.refresh()
    with pytest.raises(ValueError, match="parameter server.*2 workers"):
        DistributedSampler(range(9))


def test_sampler_resume_mid_epoch_matches_uninterrupted():
    for replicas, rank, drop_last in itertools.product((1, 3, 4), range(4), (True, False)):
        if rank >= replicas:
            continue
        full = _torch_indices(23, replicas, rank, True, 5, drop_last, 2)[0]
        s = DistributedSampler(range(23), replicas, rank, seed=5, drop_last=drop_last)
        s.set_epoch(2)
        it = iter(s)
        head = [next(it) for _ in range(3)]
        state = json.loads(json.dumps(s.state_dict()))  # JSON round trip, no pickle
        assert state == {"epoch": 2, "offset": 3 * replicas}
        fresh = DistributedSampler(range(23), replicas, rank, seed=5, drop_last=drop_last)
        fresh.load_state_dict(state)
        assert head + list(fresh) == full
        assert list(fresh) == full  # only the first pass after a load resumes


def test_sampler_state_after_a_full_pass_and_bad_states():
    s = DistributedSampler(range(10), 2, 1)
    assert s.state_dict() == {"epoch": 0, "offset": 0}
    list(s)
    assert s.state_dict() == {"epoch": 0, "offset": 0}
    for bad, match in [({"epoch": 1}, "'epoch' and 'offset'"), ({"epoch": -1, "offset": 0},
                       "epoch'\\] must be >= 0"), ({"epoch": 0, "offset": "3"}, "must be an int")]:
        with pytest.raises((ValueError, TypeError), match=match):
            s.load_state_dict(bad)


def test_sampler_resume_under_another_world_size_keeps_global_order():
    order = DistributedSampler(range(40), 1, 0, seed=3).global_order()
    old = [DistributedSampler(range(40), 4, r, seed=3) for r in range(4)]
    its = [iter(s) for s in old]
    for it in its:
        [next(it) for _ in range(3)]  # 12 global samples consumed
    state = old[0].state_dict()
    assert state == {"epoch": 0, "offset": 12}
    rest = []
    for r in range(2):
        s = DistributedSampler(range(40), 2, r, seed=3)
        s.load_state_dict(state)
        rest.append(list(s))
    assert sorted(rest[0] + rest[1]) == sorted(order[12:])
    s = DistributedSampler(range(40), 5, 0, seed=3)
    with pytest.warns(UserWarning, match="offset 12 is not a multiple of num_replicas=5"):
        s.load_state_dict(state)
    assert len(list(s)) == (40 - 10) // 5


def test_global_batches_do_not_depend_on_world_size():
    data = torch.arange(50)
    single = [set(b.tolist()) for b in shard_loader(data, 8, seed=1, rank=0, world_size=1)]
    per_rank = [list(shard_loader(data, 8, seed=1, rank=r, world_size=4)) for r in range(4)]
    assert all(len(p) == 7 for p in per_rank) and len(single) == 7
    for k in range(6):  # the last batch holds the padding of world 4 (50 -> 52)
        assert set(torch.cat([p[k] for p in per_rank]).tolist()) == single[k]


def test_loader_advances_epoch_by_itself():
    loader = shard_loader(torch.arange(20), 4, rank=0, world_size=2, seed=7)
    assert (len(loader), loader.batch_size, loader.epoch) == (5, 2, 0)
    epochs = []
    for epoch in range(3):
        got = torch.cat(list(loader)).tolist()
        ref = tud.DistributedSampler(range(20), 2, 0, seed=7)
        ref.set_epoch(epoch)
        assert got == list(ref)
        epochs.append(loader.epoch)
    assert epochs == [0, 1, 2]
    loader.set_epoch(10)
    list(loader)
    assert loader.epoch == 10
    loader.sampler.set_epoch(4)  # a torch-style user call is honoured, not doubled
    list(loader)
    assert loader.epoch == 4
    list(loader)
    assert loader.epoch == 5


def test_loader_resume_mid_epoch_equals_uninterrupted():
    data = torch.arange(37)
    ref = shard_loader(data, 6, rank=1, world_size=3)
    straight = [b.tolist() for _ in range(2) for b in ref]
    loader = shard_loader(data, 6, rank=1, world_size=3)
    seen = [b.tolist() for b in loader]  # epoch 0
    it = iter(loader)  # epoch 1
    seen += [next(it).tolist() for _ in range(4)]
    state = json.loads(json.dumps(loader.state_dict()))
    assert state == {"epoch": 1, "offset": 24}
    resumed = shard_loader(data, 6, rank=1, world_size=3)
    resumed.load_state_dict(state)
    seen += [b.tolist() for b in resumed]
    assert seen == straight
    assert resumed.state_dict() == {"epoch": 2, "offset": 0}
    assert resumed.epoch == 1
    list(resumed)
    assert resumed.epoch == 2


def test_loader_state_at_epoch_end_with_drop_last():
    loader = shard_loader(torch.arange(22), 8, rank=0, world_size=2, drop_last=True)
    assert len(loader) == 2  # 22 -> 22 per sampler (even), 11 per rank, 2 full batches of 4
    it = iter(loader)
    next(it)
    assert loader.state_dict() == {"epoch": 0, "offset": 8}
    next(it)  # the last full batch: the epoch is done even before StopIteration
    assert loader.state_dict() == {"epoch": 1, "offset": 0}


def test_loader_state_counts_delivered_batches_not_prefetched():
    loader = shard_loader(torch.arange(64), 8, rank=0, world_size=2, num_workers=1,
                          prefetch_factor=4)
    it = iter(loader)
    next(it)
    next(it)
    assert loader.state_dict() == {"epoch": 0, "offset": 16}
    del it


@pytest.mark.parametrize(
    "gbs, world, match",
    [
        (100, 3, r"global_batch_size=100 does not divide by world_size=3.*use 99 or 102"),
        (2, 4, r"global_batch_size=2 does not divide by world_size=4.*use 4 "),
        (0, 2, r"global_batch_size must be >= 1"),
    ],
)
def test_loader_global_batch_errors(gbs, world, match):
    with pytest.raises(ValueError, match=match):
        shard_loader(range(10), gbs, rank=0, world_size=world)


def test_loader_rejects_arguments_it_owns():
    with pytest.raises(TypeError, match="chooses batch_size itself"):
        shard_loader(range(10), 2, rank=0, world_size=1, batch_size=3)


def test_loader_leaves_the_global_rng_alone():
    loader = shard_loader(torch.arange(10), 2, rank=0, world_size=1)
    torch.manual_seed(0)
    list(loader)
    list(iter(loader))
    after = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(torch.rand(3), after)


def test_numpy_integers_are_accepted():
    np = pytest.importorskip("numpy")
    s = DistributedSampler(range(10), np.int64(2), np.int32(1), seed=np.int64(4))
    s.set_epoch(np.int64(3))
    assert list(s) == _torch_indices(10, 2, 1, True, 4, False, 3)[0]
    assert s.state_dict() == {"epoch": 3, "offset": 0} and type(s.state_dict()["epoch"]) is int
