"""Sequence parallelism: the pieces layers.apply_tp adds when it is switched on.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", https://arxiv.org/abs/2205.05198, section 4.2.2), as Megatron-LM implements it
(`sequence_parallel=True`): with tp > 1, the parts of a transformer layer outside the
tensor-parallel attention and MLP (LayerNorms, dropout, residual adds) run on
activations split along the sequence dim over the tp group, so their activations take
1/tp of the memory. Megatron's f/g pair becomes:

- before a column-parallel linear: all-gather the sequence (backward: reduce-scatter).
  `gathered_linear` keeps only the *shard* for backward and gathers it again there, as
  Megatron's LinearWithGradAccumulationAndAsyncCommunication does, so the linear's
  saved input shrinks by tp too.
- after a row-parallel linear: reduce-scatter along the sequence (backward: all-gather).

Same number of bytes on the wire as the two all-reduces (an all-reduce is a reduce-scatter
plus an all-gather), 1/tp of the activation memory in the replicated regions.

Parameters replicated over tp that see only a sequence shard (LayerNorm weight and bias,
a row-parallel layer's bias) get only this shard's part of their gradient: `mark_sequence_
parallel` makes autograd sum it over the tp group (Megatron marks these `sequence_parallel`
and all-reduces them in `_allreduce_layernorm_grads`).
NOTE (ordering): the sum runs inside backward, in a hook on the Parameter that autograd
calls *before* accumulating into `.grad`. So every later consumer reads the tp-summed
gradient: DataParallel's and ZeRO stage 1-2's post-accumulate hooks (the dp average /
reduce-scatter), the pipeline's tied-weight sum after the step, clip_grad_norm_ (which
counts replicated parameters once) and the optimizer. Sums over tp and dp commute, so this
equals Megatron's order (dp first in finish_grad_sync, then the tp sum); we pay one small
all-reduce per such parameter per micro-batch instead of one coalesced per step, in
exchange for working under ZeRO, which consumes gradients during backward. ZeRO stage 3
replaces the Parameters by flat units whose hooks these are not: refused (parallelize).

Who talks to whom: the ranks of one tp group (comm/ops.py all-gather, reduce-scatter,
all-reduce); nothing else.
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
