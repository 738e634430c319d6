"""The dtype rule for losses and sums: keep the input's precision, upcast only half.

A float64 model's cross-entropy, gradient norm and returned loss are computed in
float64; fp16 and bf16 ones in float32, as Megatron-LM computes its losses (fp16 has
too few exponent bits for a sum of squares, bf16 too few mantissa bits for a mean of
many tokens). Nothing is ever lowered: float32 stays float32, float64 stays float64.

Pure: no process talks to another here.
"""

from __future__ import annotations

import torch

__all__ = ["accumulation_dtype", "upcast_half"]


def accumulation_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype to sum values of `dtypes` in: the widest floating one, at least float32.

    NOTE: a collective's ranks must agree on it, so pass dtypes every rank knows (the
    whole model's parameters), not only the local ones.
    """
    out = torch.float32
    for dtype in dtypes:
        if dtype.is_floating_point:
            out = torch.promote_types(out, dtype)
    return out


def upcast_half(t: torch.Tensor) -> torch.Tensor:
    """`t` in float32 when it is fp16/bf16; any other tensor as it is (no copy)."""
    if not t.is_floating_point():
        return t
    dtype = accumulation_dtype(t.dtype)
    return t if t.dtype == dtype else t.to(dtype)
