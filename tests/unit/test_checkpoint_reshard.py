"""Slice geometry of checkpoint/reshard.py on real tensors: save under one cut, load another."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from disttrain.checkpoint.reshard import (
    ShardedTensor,
    Slice,
    assemble,
    check_tiling,
    even_slice,
    intersect,
    shard_of,
)


def _cut(full: torch.Tensor, world: int, dim: int) -> list[Slice]:
    return [even_slice(full.shape, r, world, dim) for r in range(world)]


def _load(full: torch.Tensor, saved: list[Slice], want: Slice) -> torch.Tensor:
    pieces = [full[s.index()].clone() for s in saved]
    return assemble("t", want, saved, pieces.__getitem__, full.dtype)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("size,world", [(8, 4), (7, 3), (2, 4), (0, 2), (10, 1)])
def test_even_slice_matches_tensor_split(size, world):
    full = torch.arange(size * 3).reshape(size, 3)
    expected = torch.tensor_split(full, world, dim=0)
    for r in range(world):
        assert torch.equal(full[even_slice(full.shape, r, world).index()], expected[r])


@pytest.mark.timeout(10)
def test_rows_by_four_reassemble_whole_and_reslice_to_two():
    full = torch.randn(10, 6)
    saved = _cut(full, 4, 0)
    check_tiling("w", full.shape, saved)
    whole = Slice((0, 0), (10, 6))
    assert torch.equal(_load(full, saved, whole), full)
    for r in range(2):
        want = even_slice(full.shape, r, 2, 0)
        assert torch.equal(_load(full, saved, want), full[want.index()])


@pytest.mark.timeout(10)
def test_column_pieces_load_as_row_pieces():
    full = torch.randn(6, 9, dtype=torch.float64)
    saved = _cut(full, 3, 1)  # e.g. tensor parallel, split on the input dim
    for r in range(4):
        want = even_slice(full.shape, r, 4, 0)
        assert torch.equal(_load(full, saved, want), full[want.index()])


@pytest.mark.timeout(10)
def test_only_overlapping_pieces_are_read():
    full = torch.arange(16.0).reshape(16, 1)
    saved = _cut(full, 4, 0)
    read = []

    def reader(i):
        read.append(i)
        return full[saved[i].index()]

    assemble("t", Slice((4, 0), (4, 1)), saved, reader, full.dtype)
    assert read == [1]


@pytest.mark.timeout(10)
def test_scalar_tensor_round_trips():
    full = torch.tensor(3.5)
    assert torch.equal(_load(full, [Slice((), ())], Slice((), ())), full)


@pytest.mark.timeout(10)
def test_missing_and_overlapping_pieces_are_named():
    full = torch.zeros(8, 2)
    saved = _cut(full, 4, 0)
    with pytest.raises(ValueError, match="cover 12 of 16"):
        check_tiling("layer.w", full.shape, saved[:3])
    with pytest.raises(ValueError, match="overlap"):
        check_tiling("layer.w", full.shape, saved + [Slice((1, 0), (2, 2))])
    with pytest.raises(ValueError, match="holds 12 of the 16"):
        _load(full, saved[:3], Slice((0, 0), (8, 2)))
    with pytest.raises(ValueError, match="outside"):
        check_tiling("layer.w", full.shape, [Slice((6, 0), (4, 2))])


@pytest.mark.timeout(10)
def test_sharded_tensor_validates_its_piece():
    full = torch.arange(12.0).reshape(4, 3)
    s = shard_of(full, 1, 2)
    assert s.offsets == (2, 0) and s.global_shape == (4, 3)
    assert s.local.data_ptr() == full[2:].data_ptr()  # a view, filled in place on load
    with pytest.raises(ValueError, match="does not fit"):
        ShardedTensor(torch.zeros(3, 3), (4, 3), (2, 0))
    with pytest.raises(TypeError, match="must be a tensor"):
        ShardedTensor([1, 2], (2,), (0,))
    assert intersect(Slice((0,), (2,)), Slice((2,), (2,))) is None


@pytest.mark.timeout(30)
@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(0, 7), min_size=1, max_size=3),
    save_world=st.integers(1, 5),
    load_world=st.integers(1, 5),
    data=st.data(),
)
def test_any_even_cut_loads_into_any_other(shape, save_world, load_world, data):
    full = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    save_dim = data.draw(st.integers(0, len(shape) - 1))
    load_dim = data.draw(st.integers(0, len(shape) - 1))
    saved = _cut(full, save_world, save_dim)
    check_tiling("t", full.shape, saved)
    for r in range(load_world):
        want = even_slice(full.shape, r, load_world, load_dim)
        assert torch.equal(_load(full, saved, want), full[want.index()])
