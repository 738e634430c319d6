"""Named device mesh `(pp, dp, tp)`: pure coordinate math, then process groups.

The world's ranks are laid out as `arange(world).reshape(pp, dp, tp)` (as in picotron and
Megatron-LM): tp is innermost, so a tensor-parallel group is a run of contiguous ranks
(on GPUs, the ranks of one machine with the fastest links), then dp, then pp outermost.
With pp=2, dp=2, tp=2:

    rank:  0 1 | 2 3 | 4 5 | 6 7
    pp:    0 0   0 0   1 1   1 1
    dp:    0 0   1 1   0 0   1 1
    tp:    0 1   0 1   0 1   0 1

`MeshShape` is the pure part: coordinates, ranks and peer lists as functions of (shape,
rank), checkable by hand and unit-tested without processes. `Mesh` builds on it and is
the only part that talks to torch.distributed: it creates one process group per line of
the grid along each axis, and keeps the ones this rank belongs to.

NOTE: `dist.new_group` is itself a collective over the whole world: every rank must
create every group, in the same order, even the groups it is not a member of.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["AXES", "Mesh", "MeshShape"]

AXES = ("pp", "dp", "tp")  # outermost first; tp innermost (contiguous ranks)


@dataclass(frozen=True)
class MeshShape:
    """Degrees of parallelism; pure, no processes involved."""

    pp: int = 1
    """Pipeline stages (outermost axis)."""
    dp: int = 1
    """Data-parallel replicas."""
    tp: int = 1
    """Tensor-parallel shards of each layer (innermost axis: contiguous ranks)."""

    def __post_init__(self):
        for axis in AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"mesh axis {axis} must be an integer >= 1, got {size!r}")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def size(self, axis: str) -> int:
        _check_axis(axis)
        return getattr(self, axis)

    def check_world_size(self, world_size: int) -> None:
        """Raise ValueError naming every factor when the product is not `world_size`."""
        if self.world_size != world_size:
            factors = " * ".join(f"{a}({getattr(self, a)})" for a in AXES)
            raise ValueError(
                f"{factors} != world_size({world_size}); choose degrees whose product is "
                f"the number of processes, or launch {self.world_size} processes"
            )

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of `rank`: {"pp": i, "dp": j, "tp": k}."""
        self._check_rank(rank)
        return {
            "pp": rank // (self.dp * self.tp),
            "dp": (rank // self.tp) % self.dp,
            "tp": rank % self.tp,
        }

    def rank_at(self, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        """The global rank at the given coordinates (inverse of `coords`)."""
        for axis, value in (("pp", pp), ("dp", dp), ("tp", tp)):
            if not 0 <= value < getattr(self, axis):
                raise ValueError(f"{axis} coordinate {value} is outside 0..{getattr(self, axis) - 1}")
        return (pp * self.dp + dp) * self.tp + tp

    def peers(self, rank: int, axis: str) -> list[int]:
        """Ranks that share every coordinate of `rank` except `axis` (its group), in order."""
        _check_axis(axis)
        c = self.coords(rank)
        return [self.rank_at(**{**c, axis: i}) for i in range(self.size(axis))]

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along `axis` (each a list of global ranks), in a fixed order."""
        _check_axis(axis)
        return [self.peers(r, axis) for r in range(self.world_size) if self.coords(r)[axis] == 0]

    def stage_groups(self, stages: tuple[int, ...]) -> list[list[int]]:
        """For each (dp, tp) line, the ranks of `stages` of its pipeline, in a fixed order.

        Megatron-LM's embedding group is `stage_groups((0, pp - 1))`: the first and last
        stage of each pipeline, which hold the two copies of a tied embedding.
        """
        for s in stages:
            if not 0 <= s < self.pp:
                raise ValueError(f"pipeline stage {s} is outside 0..{self.pp - 1}")
        return [[self.rank_at(pp=s, dp=d, tp=t) for s in stages]
                for d in range(self.dp) for t in range(self.tp)]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the mesh of {self.world_size} ranks ({self})")


def _check_axis(axis: str) -> None:
    if axis not in AXES:
        raise ValueError(f"unknown mesh axis {axis!r}; axes are {', '.join(AXES)}")


class Mesh:
    """A `MeshShape` bound to this process: its coordinates and its process groups.

    Building it blocks: it creates every axis group over the default process group
    (`disttrain.init()` first). Axis groups are plain torch.distributed groups.
    """

    def __init__(self, pp: int = 1, dp: int = 1, tp: int = 1):
        self.shape = MeshShape(pp=pp, dp=dp, tp=tp)
        if not dist.is_initialized():
            raise RuntimeError("Mesh needs a process group: call disttrain.init() first")
        self.shape.check_world_size(dist.get_world_size())
        self.rank = dist.get_rank()
        self.coords = self.shape.coords(self.rank)
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._stage_groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        # NOTE: every rank walks the same axes and groups in the same order (see module doc).
        for axis in AXES:
            for ranks in self.shape.groups(axis):
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    self._groups[axis] = group

    def group(self, axis: str) -> dist.ProcessGroup:
        """This rank's process group along `axis`."""
        _check_axis(axis)
        return self._groups[axis]

    def stage_group(self, stages: tuple[int, ...]) -> dist.ProcessGroup | None:
        """The group of this rank's pipeline at `stages` (None if this stage is not one).

        Megatron's embedding group is `stage_group((0, pp - 1))`. Blocks the first time
        for given `stages`: it creates every such group, so every rank must call it
        (see module doc); later calls return the kept group.
        """
        stages = tuple(sorted(set(stages)))
        if stages not in self._stage_groups:
            self._stage_groups[stages] = None
            for ranks in self.shape.stage_groups(stages):
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    self._stage_groups[stages] = group
        return self._stage_groups[stages]

    def size(self, axis: str) -> int:
        return self.shape.size(axis)

    def local_rank(self, axis: str) -> int:
        """This rank's coordinate along `axis` (its rank inside `group(axis)`)."""
        _check_axis(axis)
        return self.coords[axis]

    def peers(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along `axis`."""
        return self.shape.peers(self.rank, axis)

    def __repr__(self) -> str:
        s = self.shape
        return f"Mesh(pp={s.pp}, dp={s.dp}, tp={s.tp}, rank={self.rank}, coords={self.coords})"
