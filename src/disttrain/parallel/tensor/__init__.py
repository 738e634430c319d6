"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): sharded layers, their
communication, and sequence parallelism (Korthikanti et al. 2022).

- layers.py: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
  vocab_parallel_cross_entropy; apply.py: `apply_tp(model, mesh, plan)` (the plan's styles);
- tied.py: which parameter names share one weight (`tied_names`), kept one after sharding;
- plans.py: `TPPlan` (styles and an attribute-edit hook) and ready plans for Hugging
  Face GPT-2 and Llama-style models;
- comm.py: the autograd functions that communicate (Megatron's f and g, the sequence
  all-gather / reduce-scatter pairs); nothing else here talks to other ranks;
- sequence.py: what `sequence_parallel=True` changes in a plan (styles and hooks).
"""

from disttrain.parallel.tensor.apply import STYLES, apply_tp
from disttrain.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from disttrain.parallel.tensor.plans import TPPlan, gpt2_plan, llama_plan, plan_for
from disttrain.parallel.tensor.tied import tied_names

__all__ = ["STYLES", "ColumnParallelLinear", "RowParallelLinear", "TPPlan",
           "VocabParallelEmbedding", "apply_tp", "gpt2_plan", "llama_plan", "plan_for",
           "tied_names", "vocab_parallel_cross_entropy"]
