"""`apply_tp(model, mesh, plan)`: swap the modules a plan names for their tensor-parallel
shards, in place (the math is in layers.py, the communication in comm.py).

A plan is data, as torchtitan's: {module name or glob: style}. Styles: "colwise",
"colwise_fused:k" (an output of k equal blocks, e.g. a fused q|k|v projection: each block
is sharded by rows alike, so a rank holds whole heads of q, of k and of v), "rowwise"
(nn.Linear or Hugging Face's Conv1D), "vocab" (nn.Embedding), and the sequence-parallel
ones (sequence.py). A `TPPlan` (plans.py) adds a hook that checks the plan can be right at
this tp and edits the attributes a sharded model reads (heads per rank), run before any
module is swapped.

Talks to no one: the sharded modules talk to their tp group when they run.
"""

from __future__ import annotations

import fnmatch
import re

import torch.distributed as dist
from torch import nn

from disttrain.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    is_linear,
)
from disttrain.parallel.tensor.plans import plan_for
from disttrain.parallel.tensor.sequence import (
    SEQUENCE_STYLES,
    gather_output,
    mark_sequence_parallel,
    scatter_output,
)
from disttrain.parallel.tensor.tied import retie, tied_names

__all__ = ["apply_tp", "STYLES"]

STYLES = ("colwise", "rowwise", "vocab", "colwise_fused:<k>") + SEQUENCE_STYLES
_FUSED = re.compile(r"colwise_fused:([1-9][0-9]*)$")


def _known(style: str) -> bool:
    return style in STYLES or _FUSED.match(style) is not None


def _matches(name: str, key: str) -> bool:
    return name == key or name.endswith("." + key) or fnmatch.fnmatchcase(name, key)


def _shard(module: nn.Module, style: str, group, name: str, sp: dict | None = None) -> nn.Module:
    out = _shard_one(module, style, group, name)
    if sp and (style.startswith("colwise") or style == "rowwise"):
        out.sequence_parallel, out.sequence_dim = True, sp["dim"]
        if style == "rowwise" and out.bias is not None:  # NOTE: added to a sequence shard
            mark_sequence_parallel(out.bias, group)
    return out


def _shard_one(module: nn.Module, style: str, group, name: str) -> nn.Module:
    if style != "vocab" and not is_linear(module):
        raise TypeError(f"plan says {name!r} is {style}, but it is a {type(module).__name__}, "
                        "not an nn.Linear (or Hugging Face Conv1D)")
    fused = _FUSED.match(style)
    if style == "colwise" or fused:
        return ColumnParallelLinear.from_linear(module, group, fused=int(fused[1]) if fused else 1)
    if style == "rowwise":
        return RowParallelLinear.from_linear(module, group)
    if type(module) is not nn.Embedding:
        raise TypeError(f"plan says {name!r} is vocab, but it is a {type(module).__name__}, "
                        "not an nn.Embedding")
    return VocabParallelEmbedding.from_embedding(module, group)


def apply_tp(model: nn.Module, mesh_or_group, plan, sequence_parallel: bool = False,
             sequence_dim: int = 1, tied: list[list[str]] | None = None) -> nn.Module:
    """Replace the modules named in `plan` by their tensor-parallel shards, in place; returns
    `model`.

    Plan keys match a module's qualified name exactly, as a dotted suffix ("attn.qkv"
    matches "blocks.0.attn.qkv"), or as a glob ("blocks.*.mlp.fc"). Styles: "colwise",
    "rowwise" (nn.Linear), "vocab" (nn.Embedding), and the sequence-parallel ones
    ("sequence", "sequence_scatter", "sequence_gather"; sequence.py), which act
    only with `sequence_parallel=True` (activations outside the tp layers split along
    dim `sequence_dim`; the plan needs a "sequence_scatter" entry then). `mesh_or_group`
    is a Mesh (its tp axis is used) or a process group. `plan` is a dict, a `TPPlan`,
    whose `adjust(model, tp)` runs first, or "auto" (the ready plan of a Hugging Face GPT-2
    or Llama, plans.py). Weights tied under several names (`tied`, default the model's:
    tied.py) share one shard afterwards, as they shared one Parameter before. Blocks only
    in that shards are local copies.
    """
    if not plan:
        raise ValueError("tensor parallelism needs a plan, e.g. GPT.tp_plan, plan='auto' for a "
                         "Hugging Face GPT-2 or Llama, or {'mlp.fc': 'colwise', ...}")
    if isinstance(plan, str) and plan == "auto":
        plan = plan_for(model)
    tied = tied_names(model, tied)  # NOTE: before the swap, which gives each name its copy
    group = mesh_or_group.group("tp") if hasattr(mesh_or_group, "group") else mesh_or_group
    adjust, plan = getattr(plan, "adjust", None), getattr(plan, "styles", plan)
    for key, style in plan.items():
        if not _known(style):
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
    if adjust is not None:  # NOTE: before any swap, so an impossible plan changes nothing
        adjust(model, dist.get_world_size(group))
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
    retie(model, tied)
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
