"""The loss `train_step` uses when no `loss_fn` is given: it follows the output layer.

Under tensor parallelism a model's logits are sharded on the vocabulary only when the
plan column-sharded the layer that makes them and left its output ungathered
(Megatron's parallel LM head, `GPT.tp_plan`'s "head.lm_head": "colwise"); the loss is
then the vocab-parallel cross-entropy, which reads each rank's slice of the vocabulary.
A whole head (left out of the plan, row-parallel, or gathering its output) gives every
rank the whole logits, and the loss is the plain cross-entropy. Reading whole logits as
a shard adds about ln(tp) to the loss with no error, so a case that cannot be decided
is refused at `parallelize` with the fix (`loss_fn=`).

The output layer is `get_output_embeddings()` (Hugging Face's name for the layer that
makes the logits; disttrain's GPT has it too), on the model, or on the one submodule
that has it (a model that wraps a Hugging Face one). Without it the answer is still
certain when every column-parallel layer is paired: Megatron's plans put a row-parallel
layer after each column-parallel one in the same parent (attention's qkv -> proj, the
MLP's fc -> proj), which sums the shards back into whole values.

Pure: no process talks to another here.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from disttrain.parallel.model_loss import read_loss
from disttrain.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    vocab_parallel_cross_entropy,
)

__all__ = ["token_loss", "own_loss", "default_loss", "vocab_sharded", "output_layer",
           "unpaired_columns"]


def token_loss(group=None):
    """Mean token cross-entropy of logits (B, T, V) — or (B, T, V/tp), vocab-sharded."""
    if group is not None and dist.get_world_size(group) > 1:
        return lambda logits, y: vocab_parallel_cross_entropy(logits, y, group)
    return lambda logits, y: F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def own_loss(out, y):
    """The loss a model computed itself from the targets it was given (model_loss.py)."""
    return read_loss(out)


def default_loss(model: nn.Module, tp_group, target_arg: str | None):
    """The loss for `model` (after apply_tp) when no loss_fn is given.

    target_arg: the model's targets argument (it computes its own loss), or None (it
    returns logits). Raises ValueError naming `loss_fn=` when the plan leaves logits
    that the loss would misread (see the module docstring).
    """
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    sharded, why = vocab_sharded(model) if tp > 1 else (False, "")
    name = type(model).__name__
    fix = ("pass loss_fn=disttrain.token_loss(mesh.group('tp')) for logits sharded on the "
           "vocabulary (the vocab-parallel cross-entropy), or loss_fn=disttrain.token_loss() "
           "for whole ones")
    if target_arg is not None:
        if sharded is not False:
            raise ValueError(f"{name} computes its own loss from {target_arg}= on whole logits, "
                             f"but {why}: leave the output layer out of the plan, or {fix} "
                             f"(the model is then called without {target_arg}=; a Hugging "
                             "Face causal LM shifts its labels by one inside, do it in y)")
        return own_loss
    if sharded is None:
        raise ValueError(f"parallelize cannot tell whether {name}'s output is sharded on the "
                         f"vocabulary: {why}; {fix}, or give the model a "
                         "get_output_embeddings() that returns its output layer")
    return token_loss(tp_group if sharded else None)


def vocab_sharded(model: nn.Module) -> tuple[bool | None, str]:
    """Whether the plan left `model`'s output sharded on the vocabulary (True, False, or
    None: cannot tell), and why, in words. Call after apply_tp."""
    head, at_root = output_layer(model)
    unpaired = unpaired_columns(model)
    names = {id(m): n for n, m in model.named_modules()}
    if head is not None and (at_root or set(unpaired) <= {names.get(id(head))}):
        where = f"its output layer {names.get(id(head), type(head).__name__)!r}"
        if not isinstance(head, ColumnParallelLinear) or head.gather_output:
            return False, f"{where} is whole"
        if head.fused > 1:
            return None, f"{where} is colwise_fused, whose shards are not vocabulary ranges"
        return True, f"the plan shards {where} column-wise"
    if not unpaired:
        return False, "every column-parallel layer feeds a row-parallel one"
    return None, (f"the plan shards {', '.join(map(repr, unpaired))} column-wise with no row-parallel "
                  "layer after it in the same module, and no get_output_embeddings() says "
                  "which layer makes the output")


def output_layer(model: nn.Module) -> tuple[nn.Module | None, bool]:
    """The layer that makes the logits, by `get_output_embeddings()`: the model's own
    (True), or the one submodule's that has it (False); (None, False) if none or several."""
    own = _output_embeddings(model)
    if own is not None:
        return own, True
    found = {id(h): h for m in model.modules() if m is not model
             for h in [_output_embeddings(m)] if h is not None}
    return (next(iter(found.values())), False) if len(found) == 1 else (None, False)


def _output_embeddings(module: nn.Module) -> nn.Module | None:
    get = getattr(module, "get_output_embeddings", None)
    out = get() if callable(get) else None
    return out if isinstance(out, nn.Module) else None


def unpaired_columns(model: nn.Module) -> list[str]:
    """Names of the column-parallel layers (output not gathered) with no row-parallel
    layer registered after them in the same parent: their outputs stay sharded."""
    out = []
    for parent_name, parent in model.named_modules():
        children = list(parent.named_children())
        for i, (name, child) in enumerate(children):
            if (isinstance(child, ColumnParallelLinear) and not child.gather_output
                    and not any(isinstance(c, RowParallelLinear) for _, c in children[i + 1:])):
                out.append(f"{parent_name}.{name}" if parent_name else name)
    return out
