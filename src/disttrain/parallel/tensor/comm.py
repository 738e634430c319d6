"""The communication of tensor parallelism, as autograd functions (no math here).
Follows Megatron-LM's f and g (Shoeybi et al. 2019, arXiv 1909.08053) and its sequence-parallel pairs.

Who talks to whom: the ranks of one tensor-parallel `group` (a mesh's "tp" axis), with
blocking all-reduce / all-gather / reduce-scatter on it (comm/ops.py, so a hang names them).

More (the design and its reasons): docs/design/model-parallelism.md, "Notes from parallel/tensor/comm.py".
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from disttrain.comm import ops

__all__ = ["MegatronF", "MegatronG", "GatherLastDim", "ScatterLastDim", "f", "g",
           "gather_last_dim", "scatter_last_dim", "GatherSequence", "ReduceScatterSequence",
           "ScatterSequence", "GatherSequenceSplitGrad", "gather_sequence",
           "reduce_scatter_sequence", "scatter_sequence", "gather_sequence_split_grad",
           "check_sequence_length", "all_gather_seq", "reduce_scatter_seq"]


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
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
    """Megatron's f: forward identity, backward all-reduce (sum) over the tp group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


class MegatronG(torch.autograd.Function):
    """Megatron's g: forward all-reduce (sum) over the tp group, backward identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

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
    """Megatron's f (identity forward, all-reduce backward)."""
    if torch.compiler.is_compiling():  # NOTE: export and torch.compile keep f as one node
        return torch.ops.disttrain.tp_f(x, _group_key(group))
    return MegatronF.apply(x, group)


def g(x: torch.Tensor, group) -> torch.Tensor:
    """Megatron's g (all-reduce forward, identity backward). Blocks."""
    if torch.compiler.is_compiling():
        return torch.ops.disttrain.tp_g(x, _group_key(group))
    return MegatronG.apply(x, group)


# ---- f and g as operators, for torch.export and torch.compile ----
# NOTE: export inlines an autograd.Function's forward and drops its backward, so the
# traced stage would all-reduce forward and never backward; Dynamo cannot trace the
# recorded collective inside MegatronF/G (a graph break per layer). As operators with
# their own autograd, f and g stay single opaque nodes of the graph (a compiled graph
# calls them, they run the same recorded collectives as MegatronF/G). A process group
# cannot be an operator argument: it goes by its name, resolved in the operator as
# torch's functional collectives do (a compiled graph cannot write a table first).


def _group_key(group) -> str:
    return (group if group is not None else dist.group.WORLD).group_name


def _group(key: str):
    return dist.distributed_c10d._resolve_process_group(key)


@torch.library.custom_op("disttrain::tp_f", mutates_args=())
def _tp_f(x: torch.Tensor, group: str) -> torch.Tensor:
    return x.clone()  # NOTE: an operator may not return an alias of its input


@torch.library.custom_op("disttrain::tp_g", mutates_args=())
def _tp_g(x: torch.Tensor, group: str) -> torch.Tensor:
    return _all_reduce(x.clone(), _group(group))


@_tp_f.register_fake
def _tp_f_fake(x, group):
    return torch.empty_like(x)


@_tp_g.register_fake
def _tp_g_fake(x, group):
    return torch.empty_like(x)


def _keep_group(ctx, inputs, output):
    ctx.group = inputs[1]


_tp_f.register_autograd(lambda ctx, grad: (_all_reduce(grad.clone(), _group(ctx.group)), None),
                        setup_context=_keep_group)
_tp_g.register_autograd(lambda ctx, grad: (grad, None), setup_context=_keep_group)


def gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    return GatherLastDim.apply(x, group)


def scatter_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    return ScatterLastDim.apply(x, group)


# ---- sequence parallelism: collectives along the sequence dim ----

def check_sequence_length(length: int, world: int, dim: int) -> None:
    """Raise a ValueError saying how to fix it unless `length` splits over `world` ranks."""
    if length % world:
        raise ValueError(
            f"sequence parallelism splits the sequence (dim {dim}, length {length}) over "
            f"{world} tensor-parallel ranks, and {length} is not a multiple of {world}; use "
            f"a sequence length (block size) that is a multiple of {world}, or turn "
            "sequence_parallel off")


def all_gather_seq(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """(.., T/tp, ..) shards -> (.., T, ..), rank order along `dim`. Blocks."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    # NOTE: all_gather_into_tensor concatenates along dim 0: move `dim` there and back
    inp = x.movedim(dim, 0).contiguous()  # (T/tp, ...)
    out = torch.empty((world * inp.shape[0],) + tuple(inp.shape[1:]), dtype=x.dtype,
                      device=x.device)  # (T, ...)
    ops.all_gather_into_tensor(out, inp, group=group)
    return out.movedim(0, dim)


def reduce_scatter_seq(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """(.., T, ..) partial sums -> this rank's (.., T/tp, ..) slice of their sum. Blocks."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    check_sequence_length(x.shape[dim], world, dim)
    inp = x.movedim(dim, 0).contiguous()  # (T, ...)
    out = torch.empty((inp.shape[0] // world,) + tuple(inp.shape[1:]), dtype=x.dtype,
                      device=x.device)  # (T/tp, ...)
    ops.reduce_scatter_tensor(out, inp, group=group)
    return out.movedim(0, dim)


def _split_seq(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return x
    check_sequence_length(x.shape[dim], world, dim)
    return x.chunk(world, dim=dim)[dist.get_rank(group)].contiguous()


class GatherSequence(torch.autograd.Function):
    """All-gather along the sequence dim forward; reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather_seq(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_seq(grad, ctx.group, ctx.dim), None, None


class ReduceScatterSequence(torch.autograd.Function):
    """Reduce-scatter along the sequence dim forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return reduce_scatter_seq(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(grad, ctx.group, ctx.dim), None, None


class ScatterSequence(torch.autograd.Function):
    """Keep this rank's sequence slice forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split_seq(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(grad, ctx.group, ctx.dim), None, None


class GatherSequenceSplitGrad(torch.autograd.Function):
    """All-gather along the sequence dim forward; keep this rank's gradient slice backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather_seq(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _split_seq(grad, ctx.group, ctx.dim), None, None


def gather_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Sequence shards -> whole sequence (backward: reduce-scatter). Blocks."""
    return GatherSequence.apply(x, group, dim)


def reduce_scatter_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Partial sums over the whole sequence -> this rank's summed shard. Blocks."""
    return ReduceScatterSequence.apply(x, group, dim)


def scatter_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Replicated whole sequence -> this rank's shard (no communication forward)."""
    return ScatterSequence.apply(x, group, dim)


def gather_sequence_split_grad(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Sequence shards -> whole sequence for a replicated consumer (backward: slice). Blocks."""
    return GatherSequenceSplitGrad.apply(x, group, dim)
