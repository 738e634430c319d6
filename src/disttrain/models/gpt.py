"""A small GPT (decoder-only transformer), nanoGPT-style, with no distributed code.

Follows Radford et al. 2019 (GPT-2) as nanoGPT writes it, with two layout choices that
let strategies act on it from outside (torchtitan's way):

- blocks live in an `nn.ModuleDict` keyed "0", "1", ... and `forward` skips a missing
  embedding or head, so a pipeline stage is this same class with the other layers
  removed, and parameter names stay those of the whole model;
- the fused qkv projection is laid out per head, (n_head, 3, head_dim), and attention
  reads the head count from the tensor, so column-sharding qkv gives each tensor-parallel
  rank whole heads (as Megatron-LM lays it out).

`GPT.tp_plan` is the tensor-parallel (and sequence-parallel) plan as data;
`pipeline_layers()` names the layers a pipeline may cut between; `tied_parameters()` the
weights tied by `tie_embeddings`; `recompute_layers()` the blocks activation
recomputation may rerun; `get_output_embeddings()` the layer that makes the logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig"]


@dataclass
class GPTConfig:
    vocab_size: int = 128
    """Tokens in the vocabulary (128: ASCII characters)."""
    block_size: int = 64
    """Longest context, in tokens."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block (split across tensor-parallel ranks)."""
    n_embd: int = 64
    """Width of the residual stream."""
    tie_embeddings: bool = False
    """Share one weight between the token embedding and the LM head (GPT-2, Megatron's
    default): `head.lm_head.weight` is `embed.tok.weight`, both (vocab_size, n_embd)."""

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head "
                             f"({self.n_head}); each head gets n_embd // n_head features")


class Embed(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)

    def forward(self, idx):  # (B, T) token ids
        t = idx.shape[1]
        return self.tok(idx) + self.pos(torch.arange(t, device=idx.device))  # (B, T, C)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # out laid out (nh, 3, hs)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x):  # (B, T, C)
        qkv = self.qkv(x)  # (B, T, 3C)
        # NOTE: shapes are read from qkv's output, not x: a sequence-parallel x is (B, T/tp,
        # C) and qkv gathers it; -1 is the number of heads held (all, or a tp shard of them)
        b, t = qkv.shape[:2]
        q, k, v = qkv.view(b, t, -1, 3, self.head_dim).unbind(3)  # each (B, T, nh, hs)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x):  # (B, T, C) -> (B, T, V)
        return self.lm_head(self.ln_f(x))


class GPT(nn.Module):
    """Token ids (B, T) -> logits (B, T, V). A stage with layers removed maps what it gets."""

    tp_plan = {
        "embed.tok": "vocab",
        "attn.qkv": "colwise",
        "attn.proj": "rowwise",
        "mlp.fc": "colwise",
        "mlp.proj": "rowwise",
        "head.lm_head": "colwise",  # logits stay vocab-sharded for the vocab-parallel loss
        # sequence parallelism only (apply_tp(..., sequence_parallel=True)): the embedding's
        # output is split along the sequence, the LayerNorms run on shards, and every
        # colwise layer (qkv, fc, lm_head) gathers the sequence it needs
        "embed": "sequence_scatter",
        "ln1": "sequence",
        "ln2": "sequence",
        "head.ln_f": "sequence",
    }

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed: nn.Module | None = Embed(cfg)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.head: nn.Module | None = Head(cfg)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        if cfg.tie_embeddings:  # one Parameter under two names; named_parameters() lists it once
            self.head.lm_head.weight = self.embed.tok.weight

    def tied_parameters(self) -> list[list[str]]:
        """Names that share one weight (a strategy keeps their copies equal), or []."""
        return [["embed.tok.weight", "head.lm_head.weight"]] if self.cfg.tie_embeddings else []

    def recompute_layers(self) -> list[str]:
        """The transformer blocks: what activation recomputation reruns in backward."""
        return [f"blocks.{i}" for i in range(self.cfg.n_layer)]

    def get_output_embeddings(self) -> nn.Module | None:
        """The layer that makes the logits (Hugging Face's name; parallelize reads it to
        choose the loss: a column-sharded head needs the vocab-parallel one), or None."""
        return self.head.lm_head if self.head is not None else None

    def pipeline_layers(self) -> list[str]:
        """Names of the layers, in forward order, that a pipeline may cut between."""
        return ["embed"] + [f"blocks.{i}" for i in range(self.cfg.n_layer)] + ["head"]

    def forward(self, x):  # (B, T) ids, or (B, T, C) hidden states for a later stage
        x = self.embed(x) if self.embed is not None else x
        for block in self.blocks.values():
            x = block(x)
        return self.head(x) if self.head is not None else x

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 0.8, generator=None):
        """Sample `max_new_tokens` after `idx` (B, T); the whole model must be here."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.cfg.block_size:])[:, -1] / temperature  # (B, V)
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx
