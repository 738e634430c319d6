"""Tensor-parallel plans for models nobody here wrote: styles plus an attribute-edit hook.

A model built for one device reads its head count from attributes (Hugging Face GPT-2
splits its fused q|k|v output at `split_size` and counts `num_heads`); once its
projections are sharded, each rank holds a fraction of the heads, so those attributes
must say so. torchtitan does this edit in its `parallelize_llama` by hand
(`attention.n_heads = n_heads // tp`); here it is the plan's `adjust(model, tp)` hook, run
by `apply_tp` before anything is swapped, which also refuses a plan that cannot be right
(heads that do not divide over tp) instead of letting it compute a wrong answer.

Embeddings and the LM head stay replicated in these plans: a model that computes its own
loss needs whole logits (parallelize refuses a plan that shards its head; a model
returning logits with a sharded head gets the vocab-parallel loss, default_loss.py).
Pure: no process talks here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

__all__ = ["TPPlan", "gpt2_plan", "llama_plan", "plan_for"]


@dataclass
class TPPlan:
    """A tensor-parallel plan: what `apply_tp` shards, and how the model is told."""

    styles: dict[str, str] = field(default_factory=dict)
    """Module name (exact, dotted suffix or glob) -> style, as a plain plan dict."""
    adjust: Callable[[nn.Module, int], None] | None = None
    """(model, tp) -> None: raise if the plan cannot be right at this tp, else edit the
    attributes the sharded model reads (heads per rank). Runs before any module is swapped."""


def _heads_divide(name: str, heads: int, what: str, tp: int) -> None:
    if heads % tp:
        raise ValueError(f"{name} has {heads} {what}, which do not divide over tp={tp}: each "
                         f"tensor-parallel rank must hold whole heads; use a tp that divides {heads}")


def _gpt2_heads(model: nn.Module, tp: int) -> None:
    found = [(n, m) for n, m in model.named_modules() if type(m).__name__ == "GPT2Attention"]
    if not found:
        raise TypeError(f"gpt2_plan() is for Hugging Face GPT-2 models; {type(model).__name__} "
                        "has no GPT2Attention: give a plan of its own")
    for name, attn in found:
        if getattr(attn, "is_cross_attention", False):
            raise ValueError(f"{name} is cross-attention (separate q_attn, fused k|v): "
                             "gpt2_plan shards self-attention only")
        _heads_divide(name, attn.num_heads, "attention heads", tp)
        # NOTE: c_attn's local output is q|k|v of num_heads/tp heads each: split there
        attn.num_heads //= tp
        attn.split_size //= tp
        attn.embed_dim //= tp


def gpt2_plan() -> TPPlan:
    """Hugging Face GPT-2 (`GPT2LMHeadModel`): Megatron's attention and MLP split, on its
    Conv1D layers; the fused c_attn sharded per head in each of its q, k, v blocks."""
    return TPPlan({"attn.c_attn": "colwise_fused:3", "attn.c_proj": "rowwise",
                   "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"}, _gpt2_heads)


def _llama_heads(model: nn.Module, tp: int) -> None:
    found = [(n, m) for n, m in model.named_modules()
             if hasattr(m, "q_proj") and hasattr(m, "num_key_value_groups")]
    if not found:
        raise TypeError(f"llama_plan() is for Llama-style models (q/k/v/o_proj attention); "
                        f"{type(model).__name__} has none: give a plan of its own")
    for name, attn in found:
        cfg = attn.config
        _heads_divide(name, cfg.num_attention_heads, "attention heads", tp)
        _heads_divide(name, cfg.num_key_value_heads, "key/value heads", tp)
        for attr in ("num_heads", "num_key_value_heads"):  # read by some versions' forward
            if isinstance(getattr(attn, attr, None), int):
                setattr(attn, attr, getattr(attn, attr) // tp)


def llama_plan() -> TPPlan:
    """Llama-style models (Llama, Mistral, Qwen2 in Hugging Face): q, k, v and the MLP's
    gate and up projections colwise, o and down rowwise (torchtitan's Llama plan)."""
    return TPPlan({"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise",
                   "self_attn.v_proj": "colwise", "self_attn.o_proj": "rowwise",
                   "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
                   "mlp.down_proj": "rowwise"}, _llama_heads)


PLANS = {"gpt2": gpt2_plan, "llama": llama_plan, "mistral": llama_plan, "qwen2": llama_plan}


def plan_for(model: nn.Module) -> TPPlan:
    """The ready plan for a Hugging Face model, by its `config.model_type` (`plan="auto"`)."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind not in PLANS:
        raise ValueError(f"no ready tensor-parallel plan for {type(model).__name__} "
                         f"(model_type {kind!r}; ready: {', '.join(PLANS)}); pass a plan "
                         "{'module.name': 'colwise' | 'rowwise' | 'colwise_fused:3' | ...}")
    return PLANS[kind]()
