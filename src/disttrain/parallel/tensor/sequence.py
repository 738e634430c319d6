"""Sequence parallelism: the pieces layers.apply_tp adds when it is switched on.
Follows Megatron-LM sequence parallelism (Korthikanti et al. 2022, arXiv 2205.05198).

Who talks to whom: the ranks of one tp group (comm/ops.py all-gather, reduce-scatter,
all-reduce); nothing else.

More (the design and its reasons): docs/design/model-parallelism.md, "Notes from parallel/tensor/sequence.py".
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from disttrain.comm import ops
from disttrain.parallel.tensor.comm import (
    all_gather_seq,
    gather_sequence_split_grad,
    reduce_scatter_seq,
    scatter_sequence,
)

__all__ = ["gathered_linear", "mark_sequence_parallel", "scatter_output", "gather_output",
           "SEQUENCE_STYLES"]

SEQUENCE_STYLES = ("sequence", "sequence_scatter", "sequence_gather")
"""Plan styles that only act with sequence_parallel=True:
sequence: the module runs on sequence shards; its parameters' gradients are summed over tp.
sequence_scatter: the module's output is split along the sequence (enters the region).
sequence_gather: the module's output is all-gathered along the sequence (leaves it, for a
    consumer that is not column-parallel; a column-parallel layer gathers by itself)."""


class _GatheredLinear(torch.autograd.Function):
    """y = gather_seq(x) @ w.T + b, saving the shard x, not the gathered input."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, dim):  # x (.., T/tp, .., in), w (out/tp, in)
        ctx.group, ctx.dim, ctx.has_bias = group, dim, bias is not None
        ctx.save_for_backward(x, weight)
        full = all_gather_seq(x, group, dim)  # (.., T, .., in); blocks
        return torch.nn.functional.linear(full, weight, bias)  # (.., T, .., out/tp)

    @staticmethod
    def backward(ctx, grad):  # (.., T, .., out/tp)
        x, weight = ctx.saved_tensors
        full = all_gather_seq(x, ctx.group, ctx.dim)  # NOTE: gathered again, not kept
        grad_full = grad.matmul(weight)  # (.., T, .., in): this rank's partial sum
        grad_x = reduce_scatter_seq(grad_full, ctx.group, ctx.dim)  # (.., T/tp, .., in)
        g2 = grad.reshape(-1, grad.shape[-1])  # (N, out/tp)
        grad_w = g2.t().matmul(full.reshape(-1, full.shape[-1])).to(weight.dtype)  # (out/tp, in)
        grad_b = g2.sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None


def gathered_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group,
                    dim: int = 1) -> torch.Tensor:
    """A column-parallel linear on a sequence shard: all-gather, then x @ w.T + b. Blocks.

    Backward gathers the shard again for the weight gradient and reduce-scatters the input
    gradient (2 collectives), so only the shard is saved.
    """
    if dist.get_world_size(group) == 1:
        return torch.nn.functional.linear(x, weight, bias)
    return _GatheredLinear.apply(x, weight, bias, group, dim)


def mark_sequence_parallel(param: nn.Parameter, group) -> None:
    """Sum `param`'s gradient over `group` inside backward, before it is accumulated.

    For a parameter replicated over tp whose module saw only a sequence shard. Sets
    `param.sequence_parallel = True` (Megatron's marker); marking twice is a no-op.
    """
    if getattr(param, "sequence_parallel", False) or dist.get_world_size(group) == 1:
        return
    param.sequence_parallel = True

    def hook(grad: torch.Tensor) -> torch.Tensor:
        out = grad.contiguous().clone()
        ops.all_reduce(out, group=group)  # blocks
        return out

    param.register_hook(hook)


def scatter_output(module: nn.Module, group, dim: int = 1) -> None:
    """Split `module`'s output along the sequence dim (forward hook). No communication."""
    module.register_forward_hook(lambda _m, _i, out: scatter_sequence(out, group, dim))


def gather_output(module: nn.Module, group, dim: int = 1) -> None:
    """All-gather `module`'s output along the sequence dim (forward hook). Blocks."""
    module.register_forward_hook(lambda _m, _i, out: gather_sequence_split_grad(out, group, dim))
