"""Model and optimizer state under the unsharded model's names, for layout-free checkpoints.

A tensor-parallel model holds slices of its weights under the names the unsharded model
uses (`blocks.0.attn.qkv.weight` is rows [r*n/tp, (r+1)*n/tp) of the full weight); a
pipeline stage holds a disjoint subset of those names; a `ParallelModel` holds one or
more stage chunks. Here both are described as the Checkpoints protocol wants: every
tensor under its global name, a sharded one as a `ShardedTensor` (global shape, this
rank's offsets). The TP layers say their own slice through `sharded_state_dict()`
(parallel/tensor/layers.py); this module walks a model to collect them, and
`optimizer_state` re-keys a plain torch optimizer's state by parameter name (why and
how: docs/design/checkpoints.md, "Tensor and pipeline parallel models").

Pure code: no processes, no files (TP layers read their rank from their group).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from disttrain.checkpoint.protocols import ShardedState, StageModel
from disttrain.checkpoint.reshard import ShardedTensor

__all__ = ["BY_NAME", "FLAT_BY_NAME", "NAMES_KEY", "by_name_from_positions", "drop_state", "is_by_name", "load_optimizer_state", "materialize", "module_state", "restore_param_groups",
           "needs_by_name", "optimizer_state", "param_shards", "position_names"]

BY_NAME = "by-parameter-name"
FLAT_BY_NAME = "flat-by-parameter-name"  # ZeRO: each state tensor flat, (numel,) per name


def _roots(owner: nn.Module) -> list[nn.Module]:
    """The modules holding parameters under global names: a ParallelModel's stage
    chunks (without their DataParallel wrapper), or the module itself."""
    if isinstance(owner, StageModel):
        return list(owner.local_modules())
    return [owner]


def module_state(owner: nn.Module) -> dict[str, Any]:
    """{global name: tensor or ShardedTensor} of params and buffers (views, not copies,
    so a load may fill them in place). Does not block."""
    out: dict[str, Any] = {}
    for root in _roots(owner):
        sd: dict[str, Any] = dict(root.state_dict())
        for mod_name, mod in root.named_modules():
            if mod is not root and isinstance(mod, ShardedState):
                for k, v in mod.sharded_state_dict().items():
                    sd[f"{mod_name}.{k}"] = v
        for k, v in sd.items():
            if k in out:
                raise ValueError(f"two stage chunks of this rank both hold {k!r}")
            out[k] = v
    return out


def needs_by_name(owner: nn.Module) -> bool:
    """Whether positions alone cannot describe this model's optimizer state: some
    tensors are slices (TP) or it is a ParallelModel (stages hold different params)."""
    return isinstance(owner, StageModel) or any(
        isinstance(v, ShardedTensor) for v in module_state(owner).values())


def param_shards(owner: nn.Module) -> dict[str, tuple[nn.Parameter, tuple, tuple]]:
    """{global name: (parameter, global shape, offsets)} for every parameter here."""
    out = {}
    for root in _roots(owner):
        for mod_name, mod in root.named_modules():
            layout = mod.sharded_state_dict() if mod is not root and isinstance(mod, ShardedState) else {}
            for p_name, p in mod.named_parameters(recurse=False):
                name = f"{mod_name}.{p_name}" if mod_name else p_name
                t = layout.get(p_name)
                if isinstance(t, ShardedTensor):
                    out[name] = (p, t.global_shape, t.offsets)
                else:
                    out[name] = (p, tuple(p.shape), (0,) * p.dim())
    return out


def _names_in(opt: torch.optim.Optimizer, owner: nn.Module):
    """[(group index, name, param, global shape, offsets)] for the optimizer's params.

    NOTE: a tied weight (one Parameter under several names, or a pipeline stage's copy
    named in the ParallelModel's `aliases`) is keyed by its first name in every layout,
    so its state moves between pp=1 and pp>1 in either direction.
    """
    aliases = getattr(owner, "aliases", {})
    by_id: dict[int, tuple] = {}
    for n, (p, gs, off) in param_shards(owner).items():
        by_id.setdefault(id(p), (aliases.get(n, n), p, gs, off))
    out = []
    for gi, group in enumerate(opt.param_groups):
        for p in group["params"]:
            if id(p) not in by_id:
                raise ValueError("the optimizer holds a parameter that is not the model's; "
                                 "pass the model whose parameters the optimizer updates")
            out.append((gi, *by_id[id(p)]))
    return out


def is_by_name(tree: Any, flat: bool = False) -> bool:
    """Keyed by parameter name (`flat`: also ZeRO's flattened per-name state)."""
    return isinstance(tree, dict) and tree.get("format") in ((BY_NAME, FLAT_BY_NAME) if flat
                                                            else (BY_NAME,))


def optimizer_state(opt: torch.optim.Optimizer, owner: nn.Module) -> dict[str, Any]:
    """{'format', 'param_groups' (hyperparameters), 'group_of' {name: group},
    'state' {name: {key: ShardedTensor | tensor | scalar}}}. Does not block."""
    state: dict[str, dict[str, Any]] = {}
    group_of = {}
    for gi, name, p, gshape, offsets in _names_in(opt, owner):
        group_of[name] = gi
        st = opt.state.get(p)
        if not st:
            continue
        sharded = tuple(p.shape) != tuple(gshape)
        state[name] = {k: (ShardedTensor(v, gshape, offsets)
                           if sharded and isinstance(v, torch.Tensor) and v.shape == p.shape
                           else v) for k, v in st.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return {"format": BY_NAME, "param_groups": groups, "group_of": group_of,
            "state": dict(sorted(state.items()))}


@torch.no_grad()
def materialize(opt: torch.optim.Optimizer) -> None:
    """Give every parameter its optimizer state (one zero-gradient step at lr 0, then
    zeroed), so a load has buffers to fill; parameters are unchanged."""
    params = [p for g in opt.param_groups for p in g["params"]]
    if all(opt.state.get(p) for p in params):
        return
    grads, lrs = [p.grad for p in params], [g["lr"] for g in opt.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in opt.param_groups:
        g["lr"] = 0.0
    try:
        opt.step()
    finally:
        for p, gr in zip(params, grads):
            p.grad = gr
        for g, lr in zip(opt.param_groups, lrs):
            g["lr"] = lr
    for p in params:
        for v in opt.state[p].values():
            if isinstance(v, torch.Tensor):
                v.zero_()


NAMES_KEY = "disttrain_param_names"


def position_names(opt: torch.optim.Optimizer, owner: nn.Module) -> list[str] | None:
    """Names of the optimizer's parameters in state_dict() position order (None when
    some parameter is not the model's). Saved beside a positional state so that it can
    later load into a TP/PP model."""
    try:
        return [name for _, name, *_ in _names_in(opt, owner)]
    except ValueError:
        return None


def by_name_from_positions(saved: Any) -> tuple[dict, dict[str, str]] | None:
    """A positional optimizer skeleton saved with its parameter names, re-keyed by
    name: (by-name skeleton, {by-name tensor path: saved tensor path}); None when the
    names were not saved."""
    names = saved.get(NAMES_KEY) if isinstance(saved, dict) else None
    if not names:
        return None
    st = saved.get("state", {})
    items = st.get("__intdict__", []) if isinstance(st, dict) else []
    rename: dict[str, str] = {}
    by_name = {names[i]: _relabel(sub, f"optimizer/state/{i}/", f"optimizer/state/{names[i]}/",
                                  rename) for i, sub in items}
    groups = saved.get("param_groups", [])
    group_of = {names[i]: gi for gi, g in enumerate(groups) for i in g.get("params", [])}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    return ({"format": BY_NAME, "param_groups": groups, "group_of": group_of,
             "state": by_name}, rename)


def _relabel(node: Any, old: str, new: str, rename: dict[str, str]) -> Any:
    if isinstance(node, list):
        return [_relabel(v, old, new, rename) for v in node]
    if not isinstance(node, dict):
        return node
    if set(node) == {"__tensor__"} and node["__tensor__"].startswith(old):
        path = new + node["__tensor__"][len(old):]
        rename[path] = node["__tensor__"]
        return {"__tensor__": path}
    return {k: _relabel(v, old, new, rename) for k, v in node.items()}


def drop_state(opt: torch.optim.Optimizer, owner: nn.Module, names: list[str]) -> None:
    """Forget the optimizer state of the named parameters (as if never stepped)."""
    for _, name, p, _, _ in _names_in(opt, owner):
        if name in names:
            opt.state.pop(p, None)


def restore_param_groups(opt: torch.optim.Optimizer, tree: dict[str, Any], fix: str) -> None:
    """Copy saved hyperparameters into `opt`'s groups; ValueError (ending with `fix`) when
    the number of groups differs."""
    groups = tree.get("param_groups", [])
    if len(groups) != len(opt.param_groups):
        raise ValueError(f"checkpoint has {len(groups)} parameter groups, this optimizer "
                         f"{len(opt.param_groups)}; {fix}")
    for mine, saved in zip(opt.param_groups, groups):
        mine.update({k: v for k, v in saved.items() if k != "params"})


def load_optimizer_state(opt: torch.optim.Optimizer, owner: nn.Module,
                         tree: dict[str, Any]) -> None:
    """After the checkpointer filled the tensors in place: hyperparameters and any
    non-tensor state values. Raises ValueError when the parameter groups differ."""
    restore_param_groups(opt, tree, "build it with the same groups")
    for _, name, p, _, _ in _names_in(opt, owner):
        for k, v in tree.get("state", {}).get(name, {}).items():
            if not isinstance(v, (torch.Tensor, ShardedTensor)):
                opt.state[p][k] = v
