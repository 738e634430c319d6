"""The communication of tensor parallelism, as autograd functions (no math here).

Megatron-LM (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter
Language Models Using Model Parallelism", https://arxiv.org/abs/1909.08053, section 3,
figure 3) names two conjugate operators:

- f: identity in the forward pass, allreduce of the gradient in the backward pass.
  Placed where a replicated activation enters a column-parallel layer.
- g: allreduce in the forward pass, identity in the backward pass. Placed where the
  partial outputs of a row-parallel layer are summed.

A transformer layer has one f and one g in attention and one of each in the MLP: two
allreduces forward and two backward. Who talks to whom: the ranks of one tensor-parallel
`group` (a mesh's "tp" axis), with blocking allreduce / all-gather on it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from disttrain.comm import ops

__all__ = ["MegatronF", "MegatronG", "GatherLastDim", "ScatterLastDim", "f", "g",
           "gather_last_dim", "scatter_last_dim"]


def _allreduce(x: torch.Tensor, group) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x
    x = x.contiguous()
    ops.all_reduce(x, group=group)  # blocks
    return x


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    ops.all_gather(parts, x.contiguous(), group=group)  # blocks
    return torch.cat(parts, dim=-1)


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return x
    if x.shape[-1] % world:
        raise ValueError(f"last dim {x.shape[-1]} does not divide over {world} tensor-parallel ranks")
    return x.chunk(world, dim=-1)[dist.get_rank(group)].contiguous()


class MegatronF(torch.autograd.Function):
    """Megatron's f: forward identity, backward allreduce (sum) over the tp group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _allreduce(grad.clone(), ctx.group), None


class MegatronG(torch.autograd.Function):
    """Megatron's g: forward allreduce (sum) over the tp group, backward identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _allreduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherLastDim(torch.autograd.Function):
    """All-gather shards along the last dim forward; keep this rank's slice backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class ScatterLastDim(torch.autograd.Function):
    """Keep this rank's slice of the last dim forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


def f(x: torch.Tensor, group) -> torch.Tensor:
    """Megatron's f (identity forward, allreduce backward)."""
    return MegatronF.apply(x, group)


def g(x: torch.Tensor, group) -> torch.Tensor:
    """Megatron's g (allreduce forward, identity backward). Blocks."""
    return MegatronG.apply(x, group)


def gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    return GatherLastDim.apply(x, group)


def scatter_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    return ScatterLastDim.apply(x, group)
