"""Compute seconds of one layout's work: FLOPs at the device's rates, or measured seconds.

The one place compute time comes from (plan/cost.py asks): a layer's and the LM head's
forward and backward, and the optimizer step. Without a profile, matmul FLOPs at the
achieved matmul rate plus elementwise bytes at the achieved memory rate; with one
(`--profile` or `--calibrate`: a `LayerProfile` on the device), the measured seconds
scaled by FLOPs (or parameters) and by the ranks sharing the machine. Pure arithmetic.
"""

from __future__ import annotations

from disttrain.plan.devices import Device
from disttrain.plan.gpt import GPTSpec, LayerCost
from disttrain.plan.terms import DTYPE

__all__ = ["layer_seconds", "head_seconds", "optimizer_seconds"]


def layer_seconds(c: LayerCost, dev: Device) -> tuple[float, float, float]:
    """(forward, backward, weight-gradient) compute seconds of one layer, one micro-batch.

    The one place compute time comes from: FLOPs at the achieved matmul rate plus
    elementwise bytes at the achieved memory rate (backward twice forward, its weight
    half one forward's matmuls), or, with a measured profile (`--profile`), the profiled
    block's seconds scaled by FLOPs (b / profiled b, over tp; times the ranks sharing
    the machine), its weight half taken as half its backward.
    """
    p = dev.profile
    if p is None:
        mm, el = c.matmul_flops / dev.matmul_flops(DTYPE), c.elementwise_bytes / dev.memory_Bps
        return mm + el, 2 * (mm + el), mm
    k = c.matmul_flops / p.flops * p.share
    return p.fwd_s * k, p.bwd_s * k, p.bwd_s * k / 2


def head_seconds(m: GPTSpec, b: int, t: int, dev: Device) -> tuple[float, float]:
    """(forward, backward) seconds of the LM head on the last stage, one micro-batch."""
    flops = 2 * b * m.seq * m.hidden * m.vocab / t
    p = dev.profile
    if p is not None:
        k = flops / p.head_flops * p.share
        return p.head_fwd_s * k, p.head_bwd_s * k
    mm = flops / dev.matmul_flops(DTYPE)
    el = 2 * 4 * b * m.seq * m.vocab / t / dev.memory_Bps  # fp32 logits written, read by the loss
    return mm + el, 2 * mm + el


def optimizer_seconds(params: float, dev: Device) -> float:
    """Adam over `params` (this device's shard): read p, g, m, v, master (16 B), write 14 B
    per param; or a measured optimizer step scaled by parameters (`--calibrate`, `--profile`)."""
    p = dev.profile
    if p is not None and p.optimizer_s is not None:
        return p.optimizer_s * params / p.optimizer_params * p.share
    return 30 * params / dev.memory_Bps
