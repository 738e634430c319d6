"""Gradient buckets: which tensors share one flat buffer, and at which offsets.

Data parallelism reduces gradients in a few large collectives rather than one per
parameter (Li et al., "PyTorch Distributed", VLDB 2020, sec. 3.2.3): parameters are
packed, in reverse registration order (roughly the order backward produces their
gradients), into buckets of at most `cap_bytes`, and one collective runs per bucket.

Two layers, so other strategies can reuse them (ZeRO's reduce-scatter, for one):
- `assign_buckets` is pure arithmetic on sizes: it returns `BucketSpec`s (member
  indices, element offsets, total numel, optionally padded to a multiple of `pad_to`).
- `FlatBucket` owns one contiguous buffer for a spec and hands out per-member views.

Nobody here talks to a process group; data_parallel.py (and later zero.py) do.
"""

from __future__ import annotations

import numbers
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["BucketSizeTuner", "BucketSpec", "FlatBucket", "assign_buckets", "mb_to_bytes"]


def mb_to_bytes(mb: float) -> int:
    """Bucket capacity in bytes for `mb` megabytes (MiB, as torch DDP's bucket_cap_mb)."""
    if isinstance(mb, bool) or not isinstance(mb, numbers.Real) or not mb > 0:
        raise ValueError(f"bucket size must be > 0 MB, got {mb!r}; pass a number such as 25")
    return int(mb * 1024 * 1024)


@dataclass(frozen=True)
class BucketSpec:
    """One bucket: members (indices into the caller's tensor list) and their layout.

    `offsets[i]`/`numels[i]` place member `indices[i]` in the flat buffer (in elements);
    `numel` is the buffer length, >= sum(numels) when padded.
    """

    indices: tuple[int, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    numel: int
    key: Hashable = None

    @property
    def payload(self) -> int:
        """Elements that belong to members (the buffer minus padding)."""
        return sum(self.numels)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def assign_buckets(
    numels: Sequence[int],
    element_sizes: Sequence[int],
    cap_bytes: int,
    keys: Sequence[Hashable] | None = None,
    reverse: bool = True,
    pad_to: int = 1,
    first_cap_bytes: int | None = None,
) -> list[BucketSpec]:
    """Pack tensors into buckets of at most `cap_bytes` each (pure; never blocks).

    Tensors are visited in reverse index order when `reverse` (registration order
    reversed, as DDP does); a bucket is closed when the next tensor would overflow it.
    A tensor larger than `cap_bytes` gets a bucket of its own. Tensors with different
    `keys` (e.g. (dtype, device)) never share a bucket; each key fills its own open
    bucket. Buckets are returned in the order they were closed, which is the order a
    backward pass fills them. `pad_to` rounds every bucket's numel up (reduce-scatter
    needs a multiple of the world size). `first_cap_bytes` caps each key's first bucket
    (DDP uses 1 MiB there, so the first all-reduce starts early in backward).

    Members of a bucket are consecutive in visiting order, so a caller may lay all
    tensors of a key out in one buffer in that order and take buckets as slices of it.
    """
    if len(numels) != len(element_sizes):
        raise ValueError(f"{len(numels)} numels but {len(element_sizes)} element sizes")
    if keys is not None and len(keys) != len(numels):
        raise ValueError(f"{len(numels)} numels but {len(keys)} keys")
    if cap_bytes <= 0:
        raise ValueError(f"cap_bytes must be > 0, got {cap_bytes}")
    if pad_to < 1:
        raise ValueError(f"pad_to must be >= 1, got {pad_to}")
    order = range(len(numels) - 1, -1, -1) if reverse else range(len(numels))
    open_: dict[Hashable, list[int]] = {}  # key -> member indices of its open bucket
    used: dict[Hashable, int] = {}  # key -> bytes in its open bucket
    closed: list[tuple[Hashable, list[int]]] = []
    keys_closed: set[Hashable] = set()  # keys whose first bucket is already closed
    for i in order:
        key = keys[i] if keys is not None else None
        size = numels[i] * element_sizes[i]
        members = open_.setdefault(key, [])
        cap = cap_bytes
        if first_cap_bytes is not None and key not in keys_closed:
            cap = min(cap_bytes, first_cap_bytes)
        if members and used[key] + size > cap:
            closed.append((key, members))
            keys_closed.add(key)
            members = open_[key] = []
        if not members:
            used[key] = 0
        members.append(i)
        used[key] += size
    closed.extend((k, m) for k, m in open_.items() if m)
    return [_layout(members, numels, key, pad_to) for key, members in closed]


def _layout(members: list[int], numels: Sequence[int], key: Hashable, pad_to: int) -> BucketSpec:
    offsets, offset = [], 0
    for i in members:
        offsets.append(offset)
        offset += numels[i]
    return BucketSpec(
        indices=tuple(members),
        offsets=tuple(offsets),
        numels=tuple(numels[i] for i in members),
        numel=_round_up(offset, pad_to),
        key=key,
    )


class FlatBucket:
    """A contiguous buffer for one `BucketSpec` and a view per member.

    views[j] has the shape of member `spec.indices[j]`; writing a view writes the
    buffer, so a gradient stored as a view is reduced in place (zero copy).
    """

    def __init__(self, spec: BucketSpec, shapes: Sequence[torch.Size], dtype: torch.dtype,
                 device: torch.device, buffer: torch.Tensor | None = None):
        """Allocates a zeroed buffer, or uses `buffer` (1-D, spec.numel long, e.g. a
        slice of a larger flat buffer, so re-bucketing never moves data)."""
        self.spec = spec
        if buffer is None:
            buffer = torch.zeros(spec.numel, dtype=dtype, device=device)
        elif buffer.dim() != 1 or buffer.numel() != spec.numel or not buffer.is_contiguous():
            raise ValueError(f"FlatBucket buffer must be 1-D, contiguous, {spec.numel} long; "
                             f"got shape {tuple(buffer.shape)}")
        self.buffer = buffer  # (numel,)
        self.views = [
            self.buffer.narrow(0, off, n).view(shapes[j])
            for j, (off, n) in enumerate(zip(spec.offsets, spec.numels))
        ]

    @classmethod
    def for_tensors(cls, spec: BucketSpec, tensors: Sequence[torch.Tensor]) -> FlatBucket:
        """Buffer shaped for `tensors[i]` for i in spec.indices (dtype/device of the first)."""
        members = [tensors[i] for i in spec.indices]
        return cls(spec, [t.shape for t in members], members[0].dtype, members[0].device)

    def copy_in(self, tensors: Sequence[torch.Tensor]) -> None:
        """buffer[member j] <- tensors[spec.indices[j]] (tensors index like the spec)."""
        for view, i in zip(self.views, self.spec.indices):
            view.copy_(tensors[i])

    def copy_out(self, tensors: Sequence[torch.Tensor]) -> None:
        """tensors[spec.indices[j]] <- buffer[member j]."""
        for view, i in zip(self.views, self.spec.indices):
            tensors[i].copy_(view)


class BucketSizeTuner:
    """Choose a bucket capacity by timing training steps (bookkeeping only; never blocks).

    DDP's 25 MB is static, though the DDP paper reports up to 2x from bucket size. With
    `bucket_mb="auto"` the caller runs `warmup` steps, then `steps` steps at each
    candidate size (round robin, one step each in turn), calling `record(seconds)`
    after each and re-cutting buckets to `current_bytes()`; once `wants_agreement()`, it
    combines `candidate_times()` across ranks (max) and passes them to `agree()`, which
    keeps the fastest. A fixed size is a tuner that is `done` from the start.
    """

    CANDIDATES_MB = (1.0, 4.0, 16.0, 25.0, 64.0)

    def __init__(self, candidates_mb: Sequence[float], steps: int = 4, warmup: int = 1):
        if not candidates_mb:
            raise ValueError("BucketSizeTuner needs at least one candidate size")
        self.candidates = [mb_to_bytes(mb) for mb in candidates_mb]
        self.steps, self.warmup = steps, warmup
        self.samples: list[list[float]] = [[] for _ in self.candidates]
        self.index = 0
        self.chosen: int | None = self.candidates[0] if len(self.candidates) == 1 else None

    @classmethod
    def parse(cls, bucket_mb: float | str, total_bytes: int | None = None) -> BucketSizeTuner:
        """25 -> fixed 25 MiB; "auto" -> tune over CANDIDATES_MB (those that give distinct
        buckets for a model of `total_bytes`)."""
        if isinstance(bucket_mb, str):
            if bucket_mb != "auto":
                raise ValueError(f"bucket_mb must be a number of MiB or 'auto', got {bucket_mb!r}")
            cands = list(cls.CANDIDATES_MB)
            if total_bytes is not None:
                whole = total_bytes / 2**20
                cands = sorted({c for c in cands if c < whole} | {min(max(cands), whole)})
            return cls(cands)
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)):
            raise ValueError(f"bucket_mb must be a number of MiB or 'auto', got {bucket_mb!r}")
        return cls([float(bucket_mb)])

    @property
    def done(self) -> bool:
        return self.chosen is not None

    def current_bytes(self) -> int:
        return self.chosen if self.chosen is not None else self.candidates[self.index]

    def record(self, seconds: float) -> None:
        if self.done:
            return
        if self.warmup > 0:
            self.warmup -= 1
            return
        self.samples[self.index].append(seconds)
        # NOTE: candidates take turns step by step, so drift in machine load hits all alike.
        self.index = (self.index + 1) % len(self.candidates)

    def wants_agreement(self) -> bool:
        return not self.done and all(len(s) >= self.steps for s in self.samples)

    def candidate_times(self) -> list[float]:
        """Median step time of each candidate, in candidate order."""
        return [sorted(s)[len(s) // 2] for s in self.samples]

    def agree(self, times: Sequence[float]) -> None:
        """Keep the candidate with the smallest time (all ranks pass the same times)."""
        best = min(range(len(times)), key=lambda k: times[k])
        self.chosen = self.candidates[best]
