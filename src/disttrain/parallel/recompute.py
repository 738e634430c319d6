"""Activation recomputation: run chosen layers so that only their inputs are kept.

Chen et al. 2016 ("Training Deep Nets with Sublinear Memory Cost"), as Megatron-LM's
`--recompute-granularity full --recompute-method uniform` and DeepSpeed's activation
checkpointing: each layer's forward runs under
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`, which saves the layer's
input only; backward runs the layer's forward again.

`apply_recompute(model, layers)` (a step of `parallelize`) swaps each named layer for a
`Recompute` holding the same submodules and parameters under the same names, so
checkpoints, TP plans and `full_state_dict` see the model unchanged. No process talks to
another here; a recomputed TP layer re-issues its own forward collectives in backward
(counts and why they pair up: docs/design/model-parallelism.md, "Activation
recomputation").
"""

from __future__ import annotations

import fnmatch

from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["Recompute", "apply_recompute", "recompute_names"]


class Recompute(nn.Module):
    """`layer` whose forward is recomputed in backward; same parameter names as `layer`.

    The wrapper shares the layer's child and parameter tables instead of holding the
    layer as a child, so `blocks.0.attn.qkv.weight` keeps its name (no `.module.` in
    between, unlike torch's checkpoint_wrapper).
    """

    def __init__(self, layer: nn.Module):
        super().__init__()
        self._modules = layer._modules  # NOTE: shared tables: same names, same Parameters
        self._parameters = layer._parameters
        self._buffers = layer._buffers
        object.__setattr__(self, "_layer", layer)  # not a child: its tables are ours already

    split_backward_refusal = ("schedule 'zb-h1' walks the retained graph twice (B, then W), "
                              "which is not verified with recompute's checkpoints; use "
                              "recompute=False or schedule='1f1b'")
    """Why a split backward (pipeline/split_backward.py) does not run over this module."""

    def forward(self, *args, **kwargs):
        return checkpoint(self._layer, *args, use_reentrant=False, **kwargs)

    def extra_repr(self) -> str:
        return f"recomputes {type(self._layer).__name__}"


def recompute_names(model: nn.Module, recompute) -> list[str]:
    """The module names `recompute` (True, or names / globs like "blocks.*") selects."""
    if recompute is True:
        if not hasattr(model, "recompute_layers"):
            raise TypeError(f"recompute=True needs {type(model).__name__}.recompute_layers(); "
                            "pass the layer names instead, e.g. recompute=['blocks.*']")
        keys = list(model.recompute_layers())
    elif isinstance(recompute, (list, tuple)) and all(isinstance(k, str) for k in recompute):
        keys = list(recompute)
    else:
        raise TypeError(f"recompute must be False, True or a list of module names/globs "
                        f"(e.g. ['blocks.*']); got {recompute!r}")
    names = [n for n, _ in model.named_modules() if n]
    out = []
    for key in keys:
        hits = [n for n in names if n == key or fnmatch.fnmatchcase(n, key)]
        if not hits:
            raise ValueError(f"recompute layer {key!r} matches no module of "
                             f"{type(model).__name__}; module names look like {names[:6]}")
        out += [n for n in hits if n not in out]
    return out


def apply_recompute(model: nn.Module, layers=True) -> nn.Module:
    """Swap each layer `layers` selects for `Recompute(layer)`, in place; returns `model`.

    layers: True (the model's `recompute_layers()`) or module names / globs such as
    ["blocks.*"] (`recompute_names`). Does not block.
    """
    layers = recompute_names(model, layers)
    for name in layers:
        layer = model.get_submodule(name)
        if isinstance(layer, Recompute):
            continue
        if not list(layer.parameters()):
            raise ValueError(f"recompute layer {name!r} ({type(layer).__name__}) has no "
                             "parameters; recompute the layers that hold the work, e.g. "
                             "transformer blocks")
        if any(name.startswith(o + ".") for o in layers if o != name):
            raise ValueError(f"recompute layers {name!r} and its parent are both listed; "
                             "name one level (e.g. 'blocks.*', not 'blocks.*.mlp' too)")
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, Recompute(layer))
    return model
