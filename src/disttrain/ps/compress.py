"""Top-k gradient sparsification with error feedback for parameter-server pushes.
Follows Deep Gradient Compression (Lin et al. 2018, arXiv 1712.01887): top-k with error feedback.

Who talks to whom: the worker (worker.py) calls `ErrorFeedback.compress_parts(name, grad,
parts)` on its compute thread for each parameter of a push (top-k over the whole
parameter, split at its keys' cut points) and sends an (indices, values) pair per key; the
server (server.py) calls `densify(...)`, which checks every pair (a malformed one raises
`FrameError`: the server drops the push, counts it and tells that worker) and scatters
them into dense gradients; from there the server's policy and optimizer treat the push
as any dense one, so every consistency mode works unchanged.

More (the design and its reasons): docs/design/parameter-server.md, "Notes from ps/compress.py".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from disttrain.ps.frame import FrameError

__all__ = ["TopK", "ErrorFeedback", "parse_compression", "densify"]

_HELP = ('use None (dense), "topk:ratio=R" with 0 < R <= 1 (e.g. "topk:ratio=0.01": '
         "send 1% of each parameter's entries) or ps.TopK(ratio=R)")


@dataclass(frozen=True)
class TopK:
    """Send the ceil(ratio * numel) largest-magnitude entries of each parameter per push."""

    ratio: float = 0.01

    def __post_init__(self):
        if (not isinstance(self.ratio, (int, float)) or isinstance(self.ratio, bool)
                or not 0 < self.ratio <= 1 or math.isnan(self.ratio)):
            raise ValueError(f"TopK(ratio={self.ratio!r}): ratio must be a number in (0, 1]; "
                             + _HELP)

    def k(self, numel: int) -> int:
        """Entries sent for a key of `numel` entries (at least 1 when numel >= 1)."""
        return min(numel, max(1, math.ceil(self.ratio * numel))) if numel else 0

    def __str__(self) -> str:
        return f"topk:ratio={self.ratio:g}"


def parse_compression(spec: str | TopK | None) -> TopK | None:
    """None/"none"/"dense" -> None (dense pushes); "topk:ratio=R" or TopK -> TopK."""
    if spec is None or isinstance(spec, TopK):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"compression={spec!r} ({type(spec).__name__}); {_HELP}")
    kind, _, rest = spec.strip().partition(":")
    if kind.strip().lower() in ("none", "dense") and not rest:
        return None
    key, eq, raw = rest.partition("=")
    if kind.strip().lower() != "topk" or not eq or key.strip() != "ratio":
        raise ValueError(f"compression={spec!r} is not understood; {_HELP}")
    try:
        ratio = float(raw)
    except ValueError:
        raise ValueError(f"compression={spec!r}: ratio {raw!r} is not a number; {_HELP}") from None
    return TopK(ratio)


class ErrorFeedback:
    """One worker's residuals, per parameter (or key): what top-k selection has not sent yet.

    Used from the compute thread only (the gradient hooks and `push()`); not thread-safe.
    """

    def __init__(self, topk: TopK):
        self.topk = topk
        self.residual: dict[str, torch.Tensor] = {}  # key -> (numel,), same dtype as grads

    def compress(self, key: str, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, values) to send for `grad` (1-D) plus this key's residual; never blocks.

        The residual becomes (residual + grad) with the sent entries zeroed. The returned
        tensors are fresh (they do not alias `grad`), so `.grad` may change right after.
        """
        n = grad.numel()
        k = self.topk.k(n)
        held = self.residual.get(key)
        acc = grad.detach().clone() if held is None else held + grad.detach()  # (n,)
        index_dtype = torch.int32 if n < 2**31 else torch.int64
        if k >= n:  # ratio 1 (or a tiny key): everything goes, bit-for-bit the dense values
            self.residual.pop(key, None)
            return torch.arange(n, dtype=index_dtype), acc
        idx = torch.topk(acc.abs(), k, sorted=False).indices.sort().values  # (k,) increasing
        values = acc[idx]  # (k,) a copy
        acc[idx] = 0
        self.residual[key] = acc
        return idx.to(index_dtype), values


    def compress_parts(self, name: str, grad: torch.Tensor, parts: list[tuple[int, int]]
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`compress` over a whole parameter `name` (DGC's per-layer selection), split at
        the cut points of its keys: (indices relative to the part, values) per [start,
        stop) of `parts`, an empty pair where nothing of a part was selected. So what is
        sent does not depend on how placement cut the parameter; never blocks."""
        idx, values = self.compress(name, grad)
        bounds = torch.tensor([b for part in parts for b in part], dtype=idx.dtype)
        at = torch.searchsorted(idx, bounds).tolist()  # idx is strictly increasing
        return [(idx[at[2 * i]:at[2 * i + 1]] - start, values[at[2 * i]:at[2 * i + 1]])
                for i, (start, _) in enumerate(parts)]


def densify(keys: list[str], tensors: list[torch.Tensor],
            shard: dict[str, tuple[int, torch.dtype]], zero: list[str] = ()
            ) -> dict[str, torch.Tensor]:
    """A sparse push's (key, idx, val) pairs and its `zero` keys (top-k selected nothing
    there; they travel by name only) -> {key: dense (numel,) gradient}, for a server
    holding `shard` (key -> (numel, dtype), as schema.check_keys reads it).

    Raises FrameError naming the first problem: an odd tensor count, a pair whose two
    keys differ, an unknown or repeated key (zero keys included), indices that are not
    1-D int32/int64, strictly increasing and inside [0, numel), or values that are not
    1-D floating point of the same length. Checks everything before allocating the dense
    gradients. A zero key's gradient is what an empty pair gave: zeros.
    """
    if len(keys) != len(tensors) or len(tensors) % 2:
        raise FrameError(f"sparse push: {len(tensors)} tensors for {len(keys)} keys; "
                         "expected (indices, values) pairs")
    pairs: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    seen: set[str] = set()
    for i in range(0, len(tensors), 2):
        key, idx, val = keys[i], tensors[i], tensors[i + 1]
        if keys[i + 1] != key or key not in shard or key in seen:
            raise FrameError(f"sparse push: bad key pair {keys[i]!r}/{keys[i + 1]!r} "
                             "(unknown, repeated or mismatched)")
        seen.add(key)
        n = shard[key][0]
        if idx.dtype not in (torch.int32, torch.int64) or idx.dim() != 1:
            raise FrameError(f"sparse push: indices of {key!r} must be 1-D int32/int64, got "
                             f"{idx.dtype} of shape {list(idx.shape)}")
        if not val.is_floating_point() or val.dim() != 1 or val.numel() != idx.numel():
            raise FrameError(f"sparse push: values of {key!r} must be 1-D floating point with "
                             f"{idx.numel()} entries, got {val.dtype} of shape {list(val.shape)}")
        if idx.numel() > n:
            raise FrameError(f"sparse push: {idx.numel()} entries for {key!r} of {n}")
        if idx.numel() and (int(idx[0]) < 0 or int(idx[-1]) >= n
                            or not bool((idx[1:] > idx[:-1]).all())):
            raise FrameError(f"sparse push: indices of {key!r} must be strictly increasing "
                             f"in [0, {n})")
        pairs.append((key, idx, val))
    for key in zero:
        if key not in shard or key in seen:
            raise FrameError(f"sparse push: bad zero key {key!r} (unknown or repeated)")
        seen.add(key)
        pairs.append((key, torch.empty(0, dtype=torch.int64), torch.empty(0)))
    out = {}
    for key, idx, val in pairs:
        numel, dtype = shard[key]
        dense = torch.zeros(numel, dtype=dtype)  # (numel,)
        # NOTE: indices are unique (checked above): a plain scatter is the scatter-add
        dense[idx.long()] = val.to(dtype)
        out[key] = dense
    return out
