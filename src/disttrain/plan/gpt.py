"""What one GPT costs, per micro-batch: parameters, FLOPs and activation bytes.

The notation and formulas of Narayanan et al. 2021 (arXiv 2104.04473, sec. 5.1, eqs.
2-3) and Korthikanti et al. 2022 (arXiv 2205.05198, sec. 4, Table 2): l layers, hidden
h, a heads, sequence s, vocabulary V, micro-batch b, tensor-parallel t, 2-byte
activations. A layer is 12h^2 + 13h parameters; its forward is 24bsh^2 + 4bs^2h FLOPs
(matmuls), the LM head's 2bshV; backward is twice forward; full recompute adds one more
layer forward. Activations per layer (Korthikanti): sbh(10 + 24/t) + 5as^2b/t bytes,
34sbh/t + 5as^2b/t with sequence parallelism, 2sbh (the layer input) with full
recompute. Pure arithmetic; cost.py's `layer_seconds` turns a `LayerCost` into seconds,
the one step a measured per-layer profile would replace.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GPTSpec", "LayerCost", "parse_gpt", "layer_cost"]

NARAYANAN = "Narayanan et al. 2021 (arXiv 2104.04473), sec. 5.1"
KORTHIKANTI = "Korthikanti et al. 2022 (arXiv 2205.05198), sec. 4"


@dataclass(frozen=True)
class GPTSpec:
    """A GPT as `--model gpt:layers=L,hidden=H,heads=A,seq=S,vocab=V` gives it."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "seq", "vocab"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"gpt {name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.hidden % self.heads:
            raise ValueError(f"gpt hidden ({self.hidden}) must be a multiple of heads ({self.heads})")

    @property
    def layer_params(self) -> int:
        """12h^2 + 13h: qkv, projection and the 4h MLP with biases, two LayerNorms."""
        return 12 * self.hidden ** 2 + 13 * self.hidden

    @property
    def embed_params(self) -> int:
        """Token (Vh) and position (sh) embeddings; the LM head shares the token one."""
        return (self.vocab + self.seq) * self.hidden

    @property
    def params(self) -> int:
        """Narayanan's eq. 2: 12lh^2 (1 + 13/(12h) + (V + s)/(12lh))."""
        return self.layers * self.layer_params + self.embed_params

    def model_flops(self, tokens: float) -> float:
        """Training FLOPs of `tokens` without recompute: 3 passes, 72 B s l h^2 (1 + s/6h + V/16lh)."""
        n, h, s, v = self.layers, self.hidden, self.seq, self.vocab
        return 72 * tokens * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))


def parse_gpt(text: str) -> GPTSpec:
    """`gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200` -> GPTSpec."""
    kind, _, rest = text.partition(":")
    if kind != "gpt" or not rest:
        raise ValueError(f"--model must look like gpt:layers=L,hidden=H,heads=A,seq=S,vocab=V; "
                         f"got {text!r}")
    fields = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        if not eq or key not in GPTSpec.__dataclass_fields__:
            raise ValueError(f"--model: {item!r} is not one of layers=, hidden=, heads=, seq=, vocab=")
        try:
            fields[key] = int(float(value)) if float(value).is_integer() else value
        except ValueError:
            raise ValueError(f"--model: {key}={value!r} is not a number") from None
    missing = [k for k in GPTSpec.__dataclass_fields__ if k not in fields]
    if missing:
        raise ValueError(f"--model is missing {', '.join(k + '=' for k in missing)}")
    return GPTSpec(**fields)


@dataclass(frozen=True)
class LayerCost:
    """One transformer layer on one tensor-parallel rank, one micro-batch.

    The FLOP- and byte-derived inputs of the time model; a measured profile would give
    forward/backward seconds and saved bytes directly.
    """

    matmul_flops: float
    """Forward matmul FLOPs: (24bsh^2 + 4bs^2h) / t."""
    elementwise_bytes: float
    """Forward bytes the non-matmul ops (LayerNorm, softmax, dropout, GeLU, residual) move."""
    activation_bytes: float
    """Bytes saved for backward without recompute (Korthikanti)."""
    input_bytes: float
    """The layer input, 2sbh (2sbh/t with sequence parallelism): all full recompute keeps."""
    tp_bytes: float
    """The tensor each tp collective moves: 2bsh (the block output)."""


def layer_cost(m: GPTSpec, b: int, t: int, sp: bool) -> LayerCost:
    """The per-layer inputs of the time and memory model (formulas: module docstring)."""
    s, h, a = m.seq, m.hidden, m.heads
    sbh, as2b = s * b * h, a * s * s * b
    flops = (24 * b * s * h * h + 4 * b * s * s * h) / t
    # NOTE: without sequence parallelism LayerNorms, dropouts and residuals run whole on
    # every tp rank (Korthikanti's 10sbh); with it they run on a 1/t sequence shard.
    replicated = 22 * sbh / (t if sp else 1)  # 2 LN (4+4), 2 bias-dropout-residual (7+7)
    split = 16 * sbh / t + 9 * as2b / t  # bias-GeLU (8+8); softmax (2+2), dropout (2+2+1) as^2b
    saved = (34 * sbh / t if sp else sbh * (10 + 24 / t)) + 5 * as2b / t
    return LayerCost(flops, replicated + split, saved, 2 * sbh / (t if sp else 1), 2 * sbh)
