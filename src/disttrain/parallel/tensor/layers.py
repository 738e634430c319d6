"""Tensor (intra-layer model) parallelism: the math of Megatron-LM's sharded layers.

Follows Shoeybi et al. 2019 (https://arxiv.org/abs/1909.08053). A weight `w` of a
matmul is split across the ranks of a tensor-parallel group:

- `ColumnParallelLinear` splits `w` on its output dim: each rank computes a slice of
  the output features. By default the output stays sharded, so it feeds a
  `RowParallelLinear` directly (Megatron's MLP: fc colwise -> GeLU -> proj rowwise; and
  attention: qkv colwise, whole heads per rank -> proj rowwise).
- `RowParallelLinear` splits `w` on its input dim: each rank multiplies its slice of the
  input and the partial outputs are summed by g (all-reduce).
- `VocabParallelEmbedding` splits the vocabulary rows; `vocab_parallel_cross_entropy`
  computes the loss from vocabulary-sharded logits, so full logits are never gathered.

`apply_tp(model, mesh_or_group, plan)` swaps a model's nn.Linear / nn.Embedding modules
for these, from a plan that is data: {"attn.qkv": "colwise", "attn.proj": "rowwise"}.
Communication lives in comm.py (Megatron's f and g).

`apply_tp(..., sequence_parallel=True)` adds sequence parallelism (Korthikanti et al.
2022; sequence.py): column-parallel layers take a sequence shard and all-gather
it, row-parallel layers reduce-scatter along the sequence, and the plan's "sequence*"
entries say where the region starts (the embedding's output is scattered), which modules
run on shards (LayerNorms) and, if needed, where it ends.
"""

from __future__ import annotations

import fnmatch

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from disttrain.checkpoint.reshard import ShardedTensor
from disttrain.comm import ops
from disttrain.parallel.tensor.comm import (
    f,
    g,
    gather_last_dim,
    reduce_scatter_sequence,
    scatter_last_dim,
)
from disttrain.parallel.tensor.sequence import (
    SEQUENCE_STYLES,
    gather_output,
    gathered_linear,
    mark_sequence_parallel,
    scatter_output,
)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "apply_tp", "STYLES"]

STYLES = ("colwise", "rowwise", "vocab") + SEQUENCE_STYLES


def _shard_range(total: int, group, what: str) -> tuple[int, int]:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if total % world:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size "
                         f"({world}); pick a tp degree that divides it")
    size = total // world
    return rank * size, (rank + 1) * size


class ColumnParallelLinear(nn.Module):
    """y[..., out/tp] = f(x) @ w[out/tp, in].T + b[out/tp]; with gather_output, y is full."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None,
                 gather_output: bool = False):
        super().__init__()
        full = nn.Linear(in_features, out_features, bias=bias)  # same init as unsharded
        self._init_from(full, group, gather_output)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group, gather_output: bool = False):
        """Shard an existing nn.Linear by output features (its values, dtype, device)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._init_from(linear, group, gather_output)
        return self

    sequence_parallel = False
    """Input is a sequence shard (dim `sequence_dim`), all-gathered here (apply_tp sets it)."""
    sequence_dim = 1

    def _init_from(self, linear: nn.Linear, group, gather_output: bool) -> None:
        lo, hi = _shard_range(linear.out_features, group, "out_features")
        self.group, self.gather_output = group, gather_output
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(linear.weight.detach()[lo:hi].clone())  # (out/tp, in)
        b = linear.bias
        self.bias = nn.Parameter(b.detach()[lo:hi].clone()) if b is not None else None

    def sharded_state_dict(self) -> dict:
        """weight and bias as row slices of the unsharded nn.Linear's (for Checkpointer).

        The global tensor is exactly the unsharded layer's: shard r holds rows
        [r*out/tp, (r+1)*out/tp) (for GPT's qkv, laid out (nh, 3, hs), whole heads).
        """
        lo = self.weight.shape[0] * dist.get_rank(self.group)
        out = {"weight": ShardedTensor(self.weight.detach(), (self.out_features, self.in_features),
                                       (lo, 0))}
        if self.bias is not None:
            out["bias"] = ShardedTensor(self.bias.detach(), (self.out_features,), (lo,))
        return out

    def forward(self, x):  # (..., in) replicated, or (B, T/tp, in) with sequence_parallel
        if self.sequence_parallel:
            y = gathered_linear(x, self.weight, self.bias, self.group, self.sequence_dim)
        else:
            y = F.linear(f(x, self.group), self.weight, self.bias)  # (..., out/tp)
        return gather_last_dim(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} "
                f"(local {self.weight.shape[0]}), gather_output={self.gather_output}"
                + (", sequence_parallel" if self.sequence_parallel else ""))


class RowParallelLinear(nn.Module):
    """y[..., out] = g(x[..., in/tp] @ w[out, in/tp].T) + b; input sharded unless told."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None,
                 input_is_parallel: bool = True):
        super().__init__()
        full = nn.Linear(in_features, out_features, bias=bias)
        self._init_from(full, group, input_is_parallel)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group, input_is_parallel: bool = True):
        """Shard an existing nn.Linear by input features (its values, dtype, device)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._init_from(linear, group, input_is_parallel)
        return self

    sequence_parallel = False
    """Output reduce-scattered along dim `sequence_dim` instead of all-reduced (apply_tp)."""
    sequence_dim = 1

    def _init_from(self, linear: nn.Linear, group, input_is_parallel: bool) -> None:
        lo, hi = _shard_range(linear.in_features, group, "in_features")
        self.group, self.input_is_parallel = group, input_is_parallel
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(linear.weight.detach()[:, lo:hi].clone())  # (out, in/tp)
        b = linear.bias
        # NOTE: the bias is replicated and added once, after the sum.
        self.bias = nn.Parameter(b.detach().clone()) if b is not None else None

    def sharded_state_dict(self) -> dict:
        """weight as a column slice of the unsharded nn.Linear's; bias replicated."""
        lo = self.weight.shape[1] * dist.get_rank(self.group)
        out = {"weight": ShardedTensor(self.weight.detach(), (self.out_features, self.in_features),
                                       (0, lo))}
        if self.bias is not None:
            out["bias"] = self.bias.detach()
        return out

    def forward(self, x):  # (..., in/tp), or (..., in) when not input_is_parallel
        if not self.input_is_parallel:
            x = scatter_last_dim(x, self.group)
        y = F.linear(x, self.weight)  # (..., out) partial sum of this rank's inputs
        if self.sequence_parallel:  # (B, T/tp, out) summed over tp
            y = reduce_scatter_sequence(y, self.group, self.sequence_dim)
        else:
            y = g(y, self.group)  # (..., out) summed over tp
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local {self.weight.shape[1]}), out={self.out_features}"
                + (", sequence_parallel" if self.sequence_parallel else ""))


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (the vocabulary) are split over the tp group."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group=None):
        super().__init__()
        self._init_from(nn.Embedding(num_embeddings, embedding_dim), group)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, group):
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._init_from(emb, group)
        return self

    def _init_from(self, emb: nn.Embedding, group) -> None:
        self.group = group
        self.num_embeddings, self.embedding_dim = emb.num_embeddings, emb.embedding_dim
        self.vocab_start, self.vocab_end = _shard_range(emb.num_embeddings, group, "num_embeddings")
        self.weight = nn.Parameter(emb.weight.detach()[self.vocab_start:self.vocab_end].clone())

    def sharded_state_dict(self) -> dict:
        """weight as a row (vocabulary) slice of the unsharded nn.Embedding's."""
        return {"weight": ShardedTensor(self.weight.detach(), (self.num_embeddings,
                                        self.embedding_dim), (self.vocab_start, 0))}

    def forward(self, ids):  # (...) token ids over the full vocabulary
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight)  # (..., D), garbage rows where outside
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return g(out, self.group)  # exactly one rank contributes each row


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from logits sharded on the vocabulary dim (Megatron)."""

    @staticmethod
    def forward(ctx, logits, target, group):  # logits (N, V/tp), target (N,)
        v_local = logits.shape[-1]
        start = dist.get_rank(group) * v_local
        logits = logits.float()
        peak = logits.max(dim=-1).values
        ops.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)  # blocks
        shifted = logits - peak.unsqueeze(-1)
        outside = (target < start) | (target >= start + v_local)
        local_t = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        stats = torch.stack([picked, sum_exp])  # (2, N): one all-reduce for both
        ops.all_reduce(stats, group=group)
        picked, sum_exp = stats[0], stats[1]
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local_t, outside)
        return sum_exp.log() - picked  # (N,)

    @staticmethod
    def backward(ctx, grad_loss):  # (N,)
        softmax, local_t, outside = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        return grad * grad_loss.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group) -> torch.Tensor:
    """Mean cross-entropy of `logits` (..., V/tp) sharded on vocab against `target` (...).

    Same value and gradient as F.cross_entropy on the gathered logits; blocks (two
    all-reduces over `group`: the max, then the target logit and the sum of exps).
    """
    flat = logits.reshape(-1, logits.shape[-1])
    return _VocabParallelCrossEntropy.apply(flat, target.reshape(-1), group).mean()


def _matches(name: str, key: str) -> bool:
    return name == key or name.endswith("." + key) or fnmatch.fnmatchcase(name, key)


def _shard(module: nn.Module, style: str, group, name: str, sp: dict | None = None) -> nn.Module:
    out = _shard_one(module, style, group, name)
    if sp and style in ("colwise", "rowwise"):
        out.sequence_parallel, out.sequence_dim = True, sp["dim"]
        if style == "rowwise" and out.bias is not None:  # NOTE: added to a sequence shard
            mark_sequence_parallel(out.bias, group)
    return out


def _shard_one(module: nn.Module, style: str, group, name: str) -> nn.Module:
    if style in ("colwise", "rowwise") and type(module) is not nn.Linear:
        raise TypeError(f"plan says {name!r} is {style}, but it is a {type(module).__name__}, "
                        "not an nn.Linear")
    if style == "colwise":
        return ColumnParallelLinear.from_linear(module, group)
    if style == "rowwise":
        return RowParallelLinear.from_linear(module, group)
    if type(module) is not nn.Embedding:
        raise TypeError(f"plan says {name!r} is vocab, but it is a {type(module).__name__}, "
                        "not an nn.Embedding")
    return VocabParallelEmbedding.from_embedding(module, group)


def apply_tp(model: nn.Module, mesh_or_group, plan: dict[str, str],
             sequence_parallel: bool = False, sequence_dim: int = 1) -> nn.Module:
    """Replace the modules named in `plan` by their tensor-parallel shards, in place.

    Plan keys match a module's qualified name exactly, as a dotted suffix ("attn.qkv"
    matches "blocks.0.attn.qkv"), or as a glob ("blocks.*.mlp.fc"). Styles: "colwise",
    "rowwise" (nn.Linear), "vocab" (nn.Embedding), and the sequence-parallel ones
    ("sequence", "sequence_scatter", "sequence_gather"; sequence.py), which act
    only with `sequence_parallel=True` (activations outside the tp layers split along
    dim `sequence_dim`; the plan needs a "sequence_scatter" entry then). `mesh_or_group`
    is a Mesh (its tp axis is used) or a process group. Blocks only in that shards are
    local copies.
    """
    group = mesh_or_group.group("tp") if hasattr(mesh_or_group, "group") else mesh_or_group
    for key, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"plan[{key!r}] = {style!r}; styles are {', '.join(STYLES)}")
    names = [n for n, _ in model.named_modules() if n]
    for key in plan:
        if not any(_matches(n, key) for n in names):
            raise ValueError(f"plan key {key!r} matches no module of {type(model).__name__}; "
                             f"module names look like {names[:6]}")
    if sequence_parallel and "sequence_scatter" not in plan.values():
        raise ValueError("sequence_parallel=True needs the plan to say where activations are "
                         "split along the sequence: add e.g. {'embed': 'sequence_scatter', "
                         "'ln1': 'sequence', ...} (see GPT.tp_plan)")
    sp = dict(group=group, dim=sequence_dim) if sequence_parallel else None
    for name in names:
        styles = [s for k, s in plan.items() if _matches(name, k)]
        for style in [s for s in styles if s in SEQUENCE_STYLES]:
            if sp:
                _sequence(model.get_submodule(name), style, **sp)
        styles = [s for s in styles if s not in SEQUENCE_STYLES]
        if not styles:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, _shard(getattr(parent, attr), styles[0], group, name, sp))
    return model


def _sequence(module: nn.Module, style: str, group, dim: int) -> None:
    """Apply a sequence-parallel plan style to `module` (hooks; the module is unchanged)."""
    if style == "sequence_scatter":
        scatter_output(module, group, dim)
    elif style == "sequence_gather":
        gather_output(module, group, dim)
    else:  # "sequence": runs on shards, so its replicated parameters see part of the data
        for p in module.parameters():
            mark_sequence_parallel(p, group)
