"""Per-parameter optimizer options for ZeRO: which parameter goes to which group.

torch optimizers take param groups (`[{"params": [...], "weight_decay": 0.0}, ...]`),
but ZeRO's optimizer sees flat shards, not the module's parameters. So the groups are
declared by parameter *name* before flattening, the engines flatten each group into its
own buffers (one group never shares a flat shard with another, as in DeepSpeed's
per-group `bit16_groups_flat`), and the factory gets torch param groups over the shards:

    param_groups=lambda name, p: {"weight_decay": 0.0} if p.ndim == 1 else {}
    param_groups=[{"params": ["head.weight"], "lr": 1e-4},
                  {"params": ["norm.weight", "norm.bias"], "weight_decay": 0.0}]

A function maps (name, parameter) to its options; parameters with equal options share a
group (in order of first appearance). A list names parameters per group (tied aliases
count); parameters it does not name form a last group with no options of its own.

Pure code: no communication.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["assign_groups"]

ParamGroups = Callable[[str, nn.Parameter], dict] | list[dict] | None


def assign_groups(module: nn.Module, params: list[nn.Parameter],
                  spec: ParamGroups) -> tuple[dict[int, int], list[dict[str, Any]]]:
    """({id(param): group index}, [options of each group]) for the trainable `params`."""
    if spec is None:
        return {id(p): 0 for p in params}, [{}]
    names: dict[int, str] = {}
    by_name: dict[str, nn.Parameter] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)
        by_name[n] = p
    trainable = {id(p) for p in params}
    if callable(spec):
        return _from_function(spec, params, names)
    if not isinstance(spec, (list, tuple)) or not all(isinstance(g, dict) for g in spec):
        raise TypeError("param_groups must be a function (name, param) -> options dict, or a "
                        "list of dicts like [{'params': ['fc.bias'], 'weight_decay': 0.0}], "
                        f"got {type(spec).__name__}")
    return _from_list(spec, params, by_name, names, trainable)


def _from_function(fn, params, names):
    group_of: dict[int, int] = {}
    options: list[dict[str, Any]] = []
    for p in params:
        opts = fn(names[id(p)], p)
        if opts is None:
            opts = {}
        if not isinstance(opts, dict) or "params" in opts:
            raise TypeError(f"param_groups({names[id(p)]!r}, param) returned {opts!r}; return "
                            "a dict of optimizer options without 'params', e.g. "
                            "{'weight_decay': 0.0}, or {} for the optimizer's defaults")
        if opts not in options:
            options.append(opts)
        group_of[id(p)] = options.index(opts)
    return group_of, options


def _from_list(spec, params, by_name, names, trainable):
    group_of: dict[int, int] = {}
    options: list[dict[str, Any]] = []
    for gi, g in enumerate(spec):
        members = g.get("params")
        if isinstance(members, str) or not isinstance(members, (list, tuple)) or not members:
            raise ValueError(f"param_groups[{gi}]['params'] must be a non-empty list of "
                             f"parameter names, got {members!r}")
        for name in members:
            p = by_name.get(name) if isinstance(name, str) else None
            if p is None:
                near = sorted(n for n in by_name if str(name).split(".")[-1] in n)[:5]
                raise ValueError(f"param_groups[{gi}] names {name!r}, which is not a parameter "
                                 f"of the model; use names from module.named_parameters(), "
                                 f"e.g. {near or sorted(by_name)[:5]}")
            if id(p) not in trainable:
                raise ValueError(f"param_groups[{gi}] names {name!r}, which does not require "
                                 "grad; drop it from the groups (frozen parameters have no "
                                 "optimizer state)")
            if id(p) in group_of and group_of[id(p)] != gi:
                raise ValueError(f"parameter {names[id(p)]!r} is in param_groups "
                                 f"{group_of[id(p)]} and {gi}; put each parameter in one group")
            group_of[id(p)] = gi
        options.append({k: v for k, v in g.items() if k != "params"})
    rest = [p for p in params if id(p) not in group_of]
    if rest:
        options.append({})
        for p in rest:
            group_of[id(p)] = len(options) - 1
    return group_of, options
