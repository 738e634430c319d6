"""Data sharding for data-parallel training: which samples each rank reads, in which order.

`DistributedSampler` yields exactly the indices of `torch.utils.data.DistributedSampler`
(checked exhaustively in tests/unit/test_data.py); rank r takes every
`num_replicas`-th index from r, so the k-th batches of all ranks together are samples
[k*B, (k+1)*B) of the epoch's order and global batches do not depend on the world size.
`shard_loader` gives each rank `global_batch_size // world_size` per batch, advances the
epoch by itself, and saves its position as `{"epoch": e, "offset": g}` (samples of the
global order consumed), so a resume under another world size continues with the same
global batches. Details: docs/design/data.md.

Who talks to whom: reads rank / world size from `disttrain.runtime`; no collectives.
"""

from __future__ import annotations

import math
import operator
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from disttrain import runtime, trace

__all__ = ["DistributedSampler", "ShardLoader", "shard_loader"]


def _check_int(name: str, value: Any, low: int | None = None) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)  # int, numpy integers; not floats or strings
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})") from None
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def _default_world(rank: int | None, num_replicas: int | None) -> tuple[int, int]:
    """(rank, replicas) from disttrain.runtime; parameter servers hold no data shard.

    NOTE: in a `--workers W --servers S` job the servers are the last S ranks, so the data
    is sharded over the W workers, whose ranks 0..W-1 are the rank within the shard.
    """
    if num_replicas is None:
        num_replicas = runtime.world_size() - runtime.num_servers()
    if rank is None:
        rank = runtime.rank()
        if runtime.role() == "server":
            raise ValueError(
                f"rank {rank} is a parameter server; data is sharded over the "
                f"{num_replicas} workers only: build samplers and loaders on workers"
            )
    return rank, num_replicas


class DistributedSampler(torch.utils.data.Sampler[int]):
    """This rank's share of a map-style dataset; the same indices as torch's sampler.

    Args mirror `torch.utils.data.DistributedSampler`; `num_replicas` and `rank` default
    to `disttrain.world_size()` and `disttrain.rank()` (no process group needed).
    Iterating does not block. Call `set_epoch(e)` before each epoch to reshuffle (or use
    `shard_loader`, which does it for you). `state_dict()` / `load_state_dict()` save and
    restore the position inside an epoch; `len()` is always the full epoch's
    `num_samples`, as in torch, even when the next pass resumes part-way.
    """

    def __init__(
        self,
        dataset: Any,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if not hasattr(dataset, "__len__"):
            raise TypeError(
                f"{type(dataset).__name__} has no __len__: DistributedSampler shards a "
                "map-style dataset (with __len__ and __getitem__); shard an IterableDataset "
                "inside its __iter__ using disttrain.rank() and disttrain.world_size()"
            )
        rank, num_replicas = _default_world(rank, num_replicas)
        self.num_replicas = num_replicas = _check_int("num_replicas", num_replicas, low=1)
        self.rank = rank = _check_int("rank", rank)
        if not 0 <= rank < num_replicas:
            raise ValueError(
                f"rank {rank} is out of range for num_replicas={num_replicas}: rank must be "
                f"in [0, {num_replicas - 1}]; pass matching rank= and num_replicas=, or leave "
                "both unset to use disttrain.rank() and disttrain.world_size()"
            )
        self.seed = _check_int("seed", seed)
        self.dataset, self.shuffle, self.drop_last = dataset, bool(shuffle), bool(drop_last)
        self.epoch = 0
        n = len(dataset)
        if self.drop_last and n % num_replicas != 0:
            # Same formula as torch: the largest multiple of num_replicas below n.
            self.num_samples = math.ceil((n - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self._resume_offset = 0  # global offset where the next pass starts
        self._pass: list[int] | None = None  # [pass id, start offset, indices handed out]
        self._passes = 0

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch whose order the next pass yields (does not block)."""
        self.epoch = _check_int("epoch", epoch, low=0)

    def global_order(self) -> list[int]:
        """All ranks' indices for this epoch, interleaved: rank r takes [r::num_replicas]."""
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        if self.drop_last:
            return order[: self.total_size]
        padding = self.total_size - n
        # NOTE: pad by repeating the head as often as needed (n may be < num_replicas).
        return order + (order * math.ceil(padding / n))[:padding] if padding else order

    def __iter__(self) -> Iterator[int]:
        start, self._resume_offset = self._resume_offset, 0
        mine = self.global_order()[start + self.rank : self.total_size : self.num_replicas]
        self._passes += 1
        self._pass = [self._passes, start, 0]
        return self._walk(self._pass, mine)

    def _walk(self, state: list[int], indices: list[int]) -> Iterator[int]:
        for index in indices:
            state[2] += 1  # counted when handed out: the consumer holds it now
            yield index
        if self._pass is state:
            self._pass = None

    def __len__(self) -> int:
        return self.num_samples

    @property
    def resume_offset(self) -> int:
        """Global offset where the next pass starts (0 unless a loaded state resumes one)."""
        return self._resume_offset

    def state_dict(self) -> dict[str, int]:
        """Where the next pass starts: {"epoch", "offset"} (offset in global samples)."""
        if self._pass is None:
            return {"epoch": self.epoch, "offset": self._resume_offset}
        _, start, handed_out = self._pass
        offset = start + handed_out * self.num_replicas
        return {"epoch": self.epoch, "offset": 0 if offset >= self.total_size else offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next pass yields epoch `state["epoch"]` from global `offset` on.

        A state saved under another world size resumes too: the offset is rounded down to
        a multiple of `num_replicas` (a few samples seen twice, with a warning).
        """
        epoch, offset = _parse_state(state)
        if offset % self.num_replicas:
            rounded = offset - offset % self.num_replicas
            warnings.warn(
                f"sampler offset {offset} is not a multiple of num_replicas="
                f"{self.num_replicas} (saved under another world size?); resuming at "
                f"{rounded}, so {offset - rounded} samples are seen twice",
                stacklevel=2,
            )
            offset = rounded
        self.set_epoch(epoch)
        self._resume_offset = min(offset, self.total_size)
        self._pass = None


def _parse_state(state: Any) -> tuple[int, int]:
    if not isinstance(state, dict) or not {"epoch", "offset"} <= set(state):
        raise ValueError(
            f"a data state must be a dict with 'epoch' and 'offset', got {state!r}; "
            "pass what state_dict() returned"
        )
    epoch = _check_int("state['epoch']", state["epoch"], low=0)
    return epoch, _check_int("state['offset']", state["offset"], low=0)


def _check_global_batch(global_batch_size: int, world_size: int) -> int:
    global_batch_size = _check_int("global_batch_size", global_batch_size, low=1)
    if global_batch_size % world_size == 0:
        return global_batch_size // world_size
    below = global_batch_size - global_batch_size % world_size
    above = below + world_size
    fix = f"use {below} or {above}" if below else f"use {above} (or another multiple of it)"
    raise ValueError(
        f"global_batch_size={global_batch_size} does not divide by world_size={world_size}: "
        f"every rank must get the same per-rank batch (global_batch_size // world_size); "
        f"{fix}, or launch a number of processes that divides {global_batch_size}"
    )


_OWNED_KWARGS = ("batch_size", "shuffle", "sampler", "batch_sampler")


class ShardLoader:
    """An iterable over this rank's batches; see `shard_loader`.

    Each `iter()` starts a new epoch (0, 1, 2, ...) unless `set_epoch()` or
    `load_state_dict()` chose the next one. Iterating blocks only on data loading.
    """

    def __init__(self, dataset, global_batch_size, *, shuffle, seed, drop_last, rank,
                 world_size, **dataloader_kwargs) -> None:
        for name in _OWNED_KWARGS:
            if name in dataloader_kwargs:
                raise TypeError(
                    f"shard_loader chooses {name} itself; pass global_batch_size= and "
                    "shuffle= instead"
                )
        self.sampler = DistributedSampler(dataset, world_size, rank, shuffle, seed, drop_last)
        self.batch_size = _check_global_batch(global_batch_size, self.sampler.num_replicas)
        self.global_batch_size = self.batch_size * self.sampler.num_replicas
        self.drop_last = bool(drop_last)
        # NOTE: DataLoader draws its workers' base seed from `generator` at every iter(),
        # from torch's global RNG when there is none. The loader owns one, reseeded from
        # (seed, epoch, rank) per pass, so iterating never moves the global RNG and a
        # resumed run draws the same numbers as an uninterrupted one.
        self._generator = None
        if "generator" not in dataloader_kwargs:
            self._generator = dataloader_kwargs["generator"] = torch.Generator()
        self._loader = DataLoader(dataset, batch_size=self.batch_size, sampler=self.sampler,
                                  drop_last=self.drop_last, **dataloader_kwargs)
        self._epoch, self._started, self._pinned = 0, False, False
        self._pass: list[int] | None = None  # [start offset, batches delivered]

    @property
    def dataset(self) -> Any:
        return self.sampler.dataset

    @property
    def epoch(self) -> int:
        """The epoch of the current (or last) pass; before any pass, the first one's."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass use `epoch` (does not block)."""
        self.sampler.set_epoch(epoch)
        self._epoch, self._pinned, self._pass = self.sampler.epoch, True, None

    def _upcoming_epoch(self) -> int:
        if self.sampler.epoch != self._epoch:  # the user called sampler.set_epoch()
            return self.sampler.epoch
        return self._epoch if self._pinned or not self._started else self._epoch + 1

    def __len__(self) -> int:
        """Batches in a full epoch on this rank (the same on every rank)."""
        return len(self._loader)

    def __iter__(self) -> Iterator[Any]:
        self._epoch = self._upcoming_epoch()
        self.sampler.set_epoch(self._epoch)
        self._started, self._pinned = True, False
        self._pass = [self.sampler.resume_offset, 0]
        if self._generator is not None:
            mixed = (self.sampler.seed + self._epoch) * 1_000_003 + self.sampler.rank
            self._generator.manual_seed(mixed % 2**63)
        return self._deliver(self._pass, trace.data(self._loader))

    def _deliver(self, state: list[int], batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            state[1] += 1
            yield batch
        if self._pass is state:
            self._pass = None

    def _epoch_done(self, offset: int) -> bool:
        remaining = self.sampler.total_size - offset
        return remaining <= 0 or (self.drop_last and remaining < self.global_batch_size)

    def state_dict(self) -> dict[str, int]:
        """JSON-able position {"epoch", "offset"}: where a resumed run continues.

        Counts batches handed to the caller (not batches prefetched by workers), so save
        it after the step that used the last batch.
        """
        if self._pass is not None:
            offset = self._pass[0] + self._pass[1] * self.global_batch_size
            if not self._epoch_done(offset):
                return {"epoch": self._epoch, "offset": offset}
            return {"epoch": self._epoch + 1, "offset": 0}
        return {"epoch": self._upcoming_epoch(), "offset": self.sampler.resume_offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next pass continues epoch `state["epoch"]` after `state["offset"]` samples."""
        self.sampler.load_state_dict(state)
        self._epoch, self._pinned, self._pass = self.sampler.epoch, True, None


def shard_loader(
    dataset: Any,
    global_batch_size: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    num_workers: int = 0,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    **dataloader_kwargs: Any,
) -> ShardLoader:
    """A loader over this rank's shard with per-rank batch `global_batch_size // world_size`.

    The epoch advances by itself each time a new iteration starts. `drop_last` drops both
    the tail that does not split evenly over ranks and a last incomplete batch; without
    it the tail is padded (as torch's sampler does) and the last batch may be smaller
    (equally on every rank). `rank` / `world_size` default to the data-parallel world of
    `disttrain.runtime`; pass a mesh's dp coordinate and size for hybrid layouts. Other
    keyword arguments (pin_memory, persistent_workers, ...) go to `DataLoader`.
    Raises ValueError when `global_batch_size` does not divide by `world_size`.
    """
    return ShardLoader(dataset, global_batch_size, shuffle=shuffle, seed=seed,
                       drop_last=drop_last, rank=rank, world_size=world_size,
                       num_workers=num_workers, collate_fn=collate_fn, **dataloader_kwargs)
