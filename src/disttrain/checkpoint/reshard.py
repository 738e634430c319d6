"""Slices of global tensors: the geometry that lets a checkpoint load into another layout.

A sharded tensor is described the way torch.distributed.checkpoint and Megatron's
dist-checkpointing describe it: a *global* shape plus, for each piece, the *offsets* of
its first element and its local shape (a hyper-rectangle). A checkpoint records the
pieces that were saved; a rank that loads asks for the piece it needs now, and
`assemble` builds it from whichever saved pieces overlap it. Saved at 4 row slices and
loaded whole, or resliced to 2, or saved whole and loaded as TP columns: all the same
code.

`ShardedTensor` is the protocol object: a strategy's `sharded_state_dict()` returns it
for every tensor that is not replicated (see docs/design/checkpoints.md).

Pure tensor code: no processes, no files (the caller passes a `read(shard)` function).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "ShardedTensor",
    "Slice",
    "assemble",
    "check_tiling",
    "even_slice",
    "intersect",
    "shard_of",
]

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Slice:
    """A hyper-rectangle of a global tensor: `offsets[d] <= i[d] < offsets[d] + shape[d]`."""

    offsets: Shape
    shape: Shape

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.shape):
            raise ValueError(
                f"slice offsets {list(self.offsets)} and shape {list(self.shape)} have "
                "different numbers of dimensions"
            )
        if any(o < 0 for o in self.offsets) or any(s < 0 for s in self.shape):
            raise ValueError(f"slice offsets/shape must be >= 0, got {self}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def index(self, base: Shape | None = None) -> tuple[slice, ...]:
        """Python slices selecting this region, relative to `base` offsets (default 0)."""
        base = base or (0,) * len(self.offsets)
        return tuple(slice(o - b, o - b + s) for o, b, s in zip(self.offsets, base, self.shape))

    def within(self, global_shape: Sequence[int]) -> bool:
        return len(global_shape) == len(self.shape) and all(
            o + s <= g for o, s, g in zip(self.offsets, self.shape, global_shape)
        )


def intersect(a: Slice, b: Slice) -> Slice | None:
    """The overlap of two slices of the same tensor, or None when they do not overlap."""
    lo = tuple(max(x, y) for x, y in zip(a.offsets, b.offsets))
    hi = tuple(
        min(x + s, y + t) for x, s, y, t in zip(a.offsets, a.shape, b.offsets, b.shape)
    )
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return Slice(lo, tuple(h - low for low, h in zip(lo, hi)))


def even_slice(global_shape: Sequence[int], rank: int, world: int, dim: int = 0) -> Slice:
    """Rank `rank`'s piece when `dim` is cut into `world` pieces, as `torch.tensor_split`.

    NOTE: the first `size % world` pieces get one extra element, so a size that does not
    divide still splits (Megatron requires divisibility; we do not need to).
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world}")
    shape = list(global_shape)
    if not -len(shape) <= dim < len(shape):
        raise ValueError(f"dim {dim} is out of range for a tensor of shape {shape}")
    dim %= len(shape)
    base, extra = divmod(shape[dim], world)
    start = rank * base + min(rank, extra)
    offsets = [0] * len(shape)
    offsets[dim] = start
    shape[dim] = base + (1 if rank < extra else 0)
    return Slice(tuple(offsets), tuple(shape))


@dataclass
class ShardedTensor:
    """This rank's piece `local` of a tensor of `global_shape`, starting at `offsets`.

    Returned by `sharded_state_dict()`; on load, `local` is the destination buffer that
    the checkpointer fills in place (so its shape says which slice this rank wants).
    """

    local: torch.Tensor
    global_shape: Shape
    offsets: Shape

    def __post_init__(self) -> None:
        if not isinstance(self.local, torch.Tensor):
            raise TypeError(f"ShardedTensor.local must be a tensor, got {type(self.local).__name__}")
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.offsets = tuple(int(o) for o in self.offsets)
        piece = Slice(self.offsets, tuple(self.local.shape))
        if not piece.within(self.global_shape):
            raise ValueError(
                f"local piece {list(self.local.shape)} at offsets {list(self.offsets)} does not "
                f"fit in global shape {list(self.global_shape)}"
            )

    @property
    def slice(self) -> Slice:
        return Slice(self.offsets, tuple(self.local.shape))


def shard_of(full: torch.Tensor, rank: int, world: int, dim: int = 0) -> ShardedTensor:
    """Cut `full` with `even_slice` and wrap rank's piece (a view, not a copy)."""
    piece = even_slice(full.shape, rank, world, dim)
    return ShardedTensor(full[piece.index()], tuple(full.shape), piece.offsets)


def check_tiling(name: str, global_shape: Sequence[int], pieces: Sequence[Slice]) -> None:
    """Raise ValueError unless the distinct `pieces` tile `global_shape` exactly once."""
    distinct = list(dict.fromkeys(pieces))
    for p in distinct:
        if not p.within(global_shape):
            raise ValueError(f"{name}: piece {p} lies outside global shape {list(global_shape)}")
    for i, a in enumerate(distinct):
        for b in distinct[i + 1:]:
            if intersect(a, b) is not None:
                raise ValueError(f"{name}: pieces {a} and {b} overlap but differ")
    covered = sum(p.numel for p in distinct)
    if covered != math.prod(global_shape):
        raise ValueError(
            f"{name}: the saved pieces cover {covered} of {math.prod(global_shape)} elements "
            f"of global shape {list(global_shape)}; every element must be held by some rank"
        )


def assemble(
    name: str,
    want: Slice,
    pieces: Sequence[Slice],
    read: Callable[[int], torch.Tensor],
    dtype: torch.dtype,
) -> torch.Tensor:
    """Build the `want` region from saved `pieces` (blocks only on `read`).

    `read(i)` returns the tensor of `pieces[i]`; only overlapping pieces are read. The
    pieces must not overlap one another (check_tiling); raises if `want` is not covered.
    """
    out = torch.empty(want.shape, dtype=dtype)
    filled = 0
    for i, piece in enumerate(pieces):
        common = intersect(piece, want)
        if common is None:
            continue
        src = read(i)
        if tuple(src.shape) != piece.shape:
            raise ValueError(
                f"{name}: a saved piece has shape {list(src.shape)}, the manifest says "
                f"{list(piece.shape)}"
            )
        out[common.index(want.offsets)] = src[common.index(piece.offsets)]
        filled += common.numel
    if filled != want.numel:
        raise ValueError(
            f"{name}: the checkpoint holds {filled} of the {want.numel} elements of slice "
            f"{want}; it was saved with missing pieces"
        )
    return out
