"""The dtype rule for losses and sums: keep the input's precision, upcast only half.

A float64 model's cross-entropy, gradient norm and returned loss are computed in
float64; fp16 and bf16 ones in float32, as Megatron-LM computes its losses (fp16 has
too few exponent bits for a sum of squares, bf16 too few mantissa bits for a mean of
many tokens). Nothing is ever lowered: float32 stays float32, float64 stays float64.

Pure: no process talks to another here.
"""

from __future__ import annotations

import torch

__all__ = ["accumulation_dtype", "scale_", "sum_of_squares", "upcast_half"]


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


def sum_of_squares(tensors: list[torch.Tensor], dtype: torch.dtype, device=None) -> torch.Tensor:
    """The sum of every element squared over `tensors`, in `dtype` (0-dim, on `device`).

    One foreach kernel per (device, dtype) group, as torch.nn.utils.clip_grad_norm_ takes
    its norms, instead of a kernel chain per tensor: a tensor of another dtype is first
    copied to `dtype` (never lowered: pass accumulation_dtype's answer). No host sync.
    """
    out = torch.zeros((), dtype=dtype, device=device)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            groups.setdefault((t.device, t.dtype), []).append(t)
    for (_, kind), group in groups.items():
        same = group if kind == dtype else [t.to(dtype) for t in group]
        norms = torch._foreach_norm(same, 2)
        out += torch.stack(norms).square().sum().to(out.device)
    return out


def scale_(tensors: list[torch.Tensor], coef: torch.Tensor) -> None:
    """t *= coef for every t of `tensors` (coef a 0-dim tensor, cast to each t's dtype and
    device), with one foreach kernel per (device, dtype) group; no host sync."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    for (dev, kind), group in groups.items():
        torch._foreach_mul_(group, coef.to(device=dev, dtype=kind))
