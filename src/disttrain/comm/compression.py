"""Gradient compression for collectives: a tiny pluggable object, as in Horovod.

`compress(tensor) -> (wire_tensor, ctx)` runs before a collective and
`decompress(wire_tensor, ctx) -> tensor` after it (Sergeev & Del Balso, "Horovod",
2018; horovod/torch/compression.py). FP16 and BF16 halve the bytes on the wire; the
reduction itself then runs in the low precision, so callers should pre-scale (divide
by the world size before summing) to keep fp16 sums in range. Pure tensor functions:
nothing here talks to a process group, and nothing blocks.
"""

from __future__ import annotations

import torch

__all__ = ["Compression", "NoCompression", "FP16Compression", "BF16Compression",
           "resolve_compression"]


class Compression:
    """Base class: identity. Subclass and override both methods."""

    name = "none"

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
        return tensor, None

    def decompress(self, tensor: torch.Tensor, ctx: object) -> torch.Tensor:
        return tensor

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NoCompression(Compression):
    """Send tensors as they are."""


class _CastCompression(Compression):
    wire_dtype: torch.dtype

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
        if not tensor.is_floating_point() or tensor.dtype == self.wire_dtype:
            return tensor, None
        return tensor.to(self.wire_dtype), tensor.dtype

    def decompress(self, tensor: torch.Tensor, ctx: object) -> torch.Tensor:
        return tensor if ctx is None else tensor.to(ctx)


class FP16Compression(_CastCompression):
    """Cast floating tensors to float16 on the wire (range +-65504: pre-scale sums)."""

    name = "fp16"
    wire_dtype = torch.float16


class BF16Compression(_CastCompression):
    """Cast floating tensors to bfloat16 on the wire (fp32 range, 8 bits of mantissa)."""

    name = "bf16"
    wire_dtype = torch.bfloat16


_BY_NAME = {"none": NoCompression, "fp16": FP16Compression, "bf16": BF16Compression}


def resolve_compression(compression: Compression | str | None) -> Compression:
    """None/'none'/'fp16'/'bf16' or a Compression object -> a Compression object."""
    if compression is None:
        return NoCompression()
    if isinstance(compression, Compression):
        return compression
    if isinstance(compression, str) and compression.lower() in _BY_NAME:
        return _BY_NAME[compression.lower()]()
    raise ValueError(
        f"compression must be None, one of {sorted(_BY_NAME)} or a "
        f"disttrain.comm.compression.Compression object, got {compression!r}"
    )
