"""Tensor (intra-layer model) parallelism: the math of Megatron-LM's sharded layers.

Follows Shoeybi et al. 2019 (arXiv 1909.08053). A matmul's weight is split across the
ranks of a tensor-parallel group: `ColumnParallelLinear` on its output dim (the output
stays sharded and feeds a `RowParallelLinear`, as Megatron's MLP and attention),
`RowParallelLinear` on its input dim (partial outputs summed by g, an all-reduce);
`VocabParallelEmbedding` splits the vocabulary rows and `vocab_parallel_cross_entropy`
takes the loss from vocabulary-sharded logits without gathering them.

Who talks to whom: `apply_tp(model, mesh_or_group, plan)` (apply.py) swaps a model's
nn.Linear / Hugging Face Conv1D / nn.Embedding for these from a plan that is data
({"attn.qkv": "colwise", ...}); the communication (Megatron's f and g) is in comm.py,
sequence parallelism (Korthikanti et al. 2022) in sequence.py. Details:
docs/design/model-parallelism.md, "Tensor parallel" and "Sequence parallelism".
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from disttrain.checkpoint.reshard import ShardedTensor
from disttrain.comm import ops
from disttrain.dtypes import upcast_half
from disttrain.parallel.tensor.comm import (
    f,
    g,
    gather_last_dim,
    reduce_scatter_sequence,
    scatter_last_dim,
)
from disttrain.parallel.tensor.sequence import gathered_linear

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "is_linear"]


def _shard_range(total: int, group, what: str) -> tuple[int, int]:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if total % world:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size "
                         f"({world}); pick a tp degree that divides it")
    size = total // world
    return rank * size, (rank + 1) * size


def is_linear(module: nn.Module) -> bool:
    """An nn.Linear, or Hugging Face's Conv1D (GPT-2: a linear layer whose weight is (in, out))."""
    if type(module) is nn.Linear:
        return True
    w = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(w, torch.Tensor)
            and tuple(w.shape) == (getattr(module, "nx", None), getattr(module, "nf", None)))


def _out_in(linear: nn.Module) -> tuple[torch.Tensor, bool]:
    """The weight as (out, in), and whether the module stores it transposed (Conv1D)."""
    return (linear.weight, False) if type(linear) is nn.Linear else (linear.weight.t(), True)


def _fused_rows(total: int, fused: int, group) -> torch.Tensor:
    """Output rows of this rank: its slice of each of `fused` equal blocks (q|k|v: 3)."""
    if total % fused:
        raise ValueError(f"out_features ({total}) is not {fused} equal fused blocks; check "
                         f"the plan's colwise_fused:{fused}")
    block = total // fused
    lo, hi = _shard_range(block, group, f"each of the {fused} fused blocks' out_features")
    return torch.cat([torch.arange(b * block + lo, b * block + hi) for b in range(fused)])


class ColumnParallelLinear(nn.Module):
    """y[..., out/tp] = f(x) @ w[out/tp, in].T + b[out/tp]; with gather_output, y is full."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None,
                 gather_output: bool = False):
        super().__init__()
        full = nn.Linear(in_features, out_features, bias=bias)  # same init as unsharded
        self._init_from(full, group, gather_output)

    @classmethod
    def from_linear(cls, linear: nn.Module, group, gather_output: bool = False, fused: int = 1):
        """Shard an existing nn.Linear (or Conv1D) by output features (its values, dtype,
        device); with fused=k the output is k blocks (q|k|v) and each is sharded alike."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._init_from(linear, group, gather_output, fused)
        return self

    sequence_parallel = False
    """Input is a sequence shard (dim `sequence_dim`), all-gathered here (apply_tp sets it)."""
    sequence_dim = 1
    transposed = False
    """Weight kept (in, out/tp), as Hugging Face's Conv1D keeps it, so names and layout match."""
    fused = 1
    """Output made of this many equal blocks (fused q|k|v: 3), each sharded by rows alike."""

    def _init_from(self, linear: nn.Module, group, gather_output: bool, fused: int = 1) -> None:
        w, self.transposed = _out_in(linear)
        self.out_features, self.in_features = w.shape
        rows = _fused_rows(self.out_features, fused, group)
        self.group, self.gather_output, self.fused = group, gather_output, fused
        local = w.detach()[rows].clone()  # (out/tp, in)
        self.weight = nn.Parameter(local.t().contiguous() if self.transposed else local)
        b = linear.bias
        self.bias = nn.Parameter(b.detach()[rows].clone()) if b is not None else None

    def shard_dim(self, param: str) -> int:
        """The dim of `param` split over tp."""
        return 1 if self.transposed and param == "weight" else 0

    def sharded_state_dict(self) -> dict:
        """weight and bias as row slices of the unsharded nn.Linear's (for Checkpointer).

        The global tensor is exactly the unsharded layer's: shard r holds rows
        [r*out/tp, (r+1)*out/tp) (for GPT's qkv, laid out (nh, 3, hs), whole heads).
        """
        if self.fused > 1:
            raise ValueError("a colwise_fused layer's shard is not one slice of the weight; "
                             "save the model with full_state_dict() instead of a sharded checkpoint")
        lo = self.out_features // dist.get_world_size(self.group) * dist.get_rank(self.group)
        shape, at = (self.out_features, self.in_features), (lo, 0)
        if self.transposed:
            shape, at = shape[::-1], at[::-1]
        out = {"weight": ShardedTensor(self.weight.detach(), shape, at)}
        if self.bias is not None:
            out["bias"] = ShardedTensor(self.bias.detach(), (self.out_features,), (lo,))
        return out

    def forward(self, x):  # (..., in) replicated, or (B, T/tp, in) with sequence_parallel
        if self.sequence_parallel:
            y = gathered_linear(x, self._w(), self.bias, self.group, self.sequence_dim)
        else:
            y = F.linear(f(x, self.group), self._w(), self.bias)  # (..., out/tp)
        return gather_last_dim(y, self.group) if self.gather_output else y

    def _w(self) -> torch.Tensor:  # (out/tp, in)
        return self.weight.t() if self.transposed else self.weight

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
    def from_linear(cls, linear: nn.Module, group, input_is_parallel: bool = True):
        """Shard an existing nn.Linear (or Conv1D) by input features (values, dtype, device)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._init_from(linear, group, input_is_parallel)
        return self

    sequence_parallel = False
    """Output reduce-scattered along dim `sequence_dim` instead of all-reduced (apply_tp)."""
    sequence_dim = 1
    transposed = False
    """Weight kept (in/tp, out), as Hugging Face's Conv1D keeps it."""

    def _init_from(self, linear: nn.Module, group, input_is_parallel: bool) -> None:
        w, self.transposed = _out_in(linear)
        self.out_features, self.in_features = w.shape
        lo, hi = _shard_range(self.in_features, group, "in_features")
        self.group, self.input_is_parallel = group, input_is_parallel
        local = w.detach()[:, lo:hi].clone()  # (out, in/tp)
        self.weight = nn.Parameter(local.t().contiguous() if self.transposed else local)
        b = linear.bias
        # NOTE: the bias is replicated and added once, after the sum.
        self.bias = nn.Parameter(b.detach().clone()) if b is not None else None

    def sharded_state_dict(self) -> dict:
        """weight as a column slice of the unsharded nn.Linear's; bias replicated."""
        lo = self.in_features // dist.get_world_size(self.group) * dist.get_rank(self.group)
        shape, at = (self.out_features, self.in_features), (0, lo)
        if self.transposed:
            shape, at = shape[::-1], at[::-1]
        out = {"weight": ShardedTensor(self.weight.detach(), shape, at)}
        if self.bias is not None:
            out["bias"] = self.bias.detach()
        return out

    def forward(self, x):  # (..., in/tp), or (..., in) when not input_is_parallel
        if not self.input_is_parallel:
            x = scatter_last_dim(x, self.group)
        w = self.weight.t() if self.transposed else self.weight  # (out, in/tp)
        y = F.linear(x, w)  # (..., out) partial sum of this rank's inputs
        if self.sequence_parallel:  # (B, T/tp, out) summed over tp
            y = reduce_scatter_sequence(y, self.group, self.sequence_dim)
        else:
            y = g(y, self.group)  # (..., out) summed over tp
        return y + self.bias if self.bias is not None else y

    def shard_dim(self, param: str) -> int | None:
        """The dim of `param` split over tp (the bias is replicated)."""
        return (0 if self.transposed else 1) if param == "weight" else None

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local {self.in_features // dist.get_world_size(self.group)}), out={self.out_features}"
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
        ctx.dtype = logits.dtype
        logits = upcast_half(logits)  # NOTE: fp16/bf16 -> fp32; float64 stays float64
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
        grad = grad * grad_loss.to(grad.dtype).unsqueeze(-1)
        return grad.to(ctx.dtype), None, None  # in the logits' dtype, as autograd expects


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group) -> torch.Tensor:
    """Mean cross-entropy of `logits` (..., V/tp) sharded on vocab against `target` (...).

    Same value and gradient as F.cross_entropy on the gathered logits; blocks (two
    all-reduces over `group`: the max, then the target logit and the sum of exps).
    Computed in the logits' dtype (fp16/bf16: in fp32), the loss in that dtype, the
    gradient in the logits' own.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    return _VocabParallelCrossEntropy.apply(flat, target.reshape(-1), group).mean()
