"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): sharded layers, their
communication, and sequence parallelism (Korthikanti et al. 2022).

- layers.py: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
  vocab_parallel_cross_entropy, and `apply_tp(model, mesh, plan)` (the plan's styles);
- comm.py: the autograd functions that communicate (Megatron's f and g, the sequence
  all-gather / reduce-scatter pairs); nothing else here talks to other ranks;
- sequence.py: what `sequence_parallel=True` changes in a plan (styles and hooks).
"""

from disttrain.parallel.tensor.layers import (
    STYLES,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_tp,
    vocab_parallel_cross_entropy,
)

__all__ = ["STYLES", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "apply_tp", "vocab_parallel_cross_entropy"]
