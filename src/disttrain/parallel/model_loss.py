"""Models that compute their own loss: which argument takes the targets, where the loss is.

A Hugging Face model takes `labels=` and returns an output object with `.loss`; a
nanoGPT copy takes `targets=` and returns `(logits, loss)`. `parallelize` asks
`target_arg(model)` once; when it names an argument (and no `loss_fn` is given), the last
pipeline stage calls `model(x, **{arg: y})` and `read_loss` takes the loss from what it
returns, as Accelerate and DeepSpeed users write `model(**batch).loss`.

Pure: no process talks to another here.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

__all__ = ["TARGET_ARGS", "target_arg", "read_loss"]

TARGET_ARGS = ("labels", "targets", "target")
"""Names of a forward argument that takes the targets, in the order they are looked for."""


def target_arg(model: nn.Module) -> str | None:
    """The name of `model.forward`'s targets argument (see TARGET_ARGS), or None."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a builtin or C forward: no names to read
        return None
    return next((name for name in TARGET_ARGS if name in params), None)


def read_loss(out) -> torch.Tensor:
    """The loss in a model's output: a 0-dim tensor, an object's `.loss` (Hugging Face), or
    the one 0-dim floating tensor of a tuple (nanoGPT's `(logits, loss)`)."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    if isinstance(out, (tuple, list)):
        scalars = [t for t in out if isinstance(t, torch.Tensor) and t.dim() == 0
                   and t.is_floating_point()]
        if len(scalars) == 1:
            return scalars[0]
    raise TypeError(
        f"the model was given the targets but returned {_describe(out)}, with no loss in it; "
        "return the loss (a 0-dim tensor, a tuple holding one, or an object with .loss), "
        "or pass loss_fn=lambda output, y: ... to parallelize (the model is then called "
        "without the targets)")


def _describe(out) -> str:
    if isinstance(out, torch.Tensor):
        return f"a tensor of shape {tuple(out.shape)}"
    if isinstance(out, (tuple, list)):
        return f"a {type(out).__name__} of {len(out)}"
    return f"a {type(out).__name__}"
