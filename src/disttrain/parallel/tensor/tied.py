"""Weights tied under several names (an embedding and the output layer): which names
share one Parameter, and making them share it again after tensor parallelism sharded
each name into its own copy. `apply_tp` calls both; across pipeline stages the copies are
kept equal by pipeline/tied.py.

Pure: no process talks to another here.
"""

from __future__ import annotations

from torch import nn

__all__ = ["retie", "tied_names"]


def tied_names(model: nn.Module, tied=None) -> list[list[str]]:
    """The tied sets: `tied` if given, else `model.tied_parameters()`, else the names
    under which one Parameter appears more than once. Each set is checked."""
    if tied is None and hasattr(model, "tied_parameters"):
        tied = model.tied_parameters()
    if tied is None:
        by_id: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(p), []).append(name)
        tied = [names for names in by_id.values() if len(names) > 1]
    params = dict(model.named_parameters(remove_duplicate=False))
    out = []
    for names in tied:
        names = list(names)
        missing = [n for n in names if n not in params]
        if len(names) < 2 or missing:
            raise ValueError(f"tied set {names} must name at least two parameters of "
                             f"{type(model).__name__}; not found: {missing}")
        shapes = {n: tuple(params[n].shape) for n in names}
        if len(set(shapes.values())) > 1:
            raise ValueError(f"tied parameters must have one shape, got {shapes}; tie only "
                             "weights of one shape (e.g. nn.Embedding(V, C) and "
                             "nn.Linear(C, V, bias=False))")
        if len({id(params[n]) for n in names}) > 1:
            raise ValueError(f"tied {names} are separate Parameters in {type(model).__name__}; "
                             f"tie them in the model first (model.{names[1]} = "
                             f"model.{names[0]}), so the single-process model is the reference")
        out.append(names)
    return out


def retie(model: nn.Module, tied: list[list[str]]) -> None:
    """Make every name of each tied set the first name's Parameter again (after TP has
    sharded each into its own copy). Raises ValueError if the shards differ in shape."""
    for names in tied:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            p = model.get_parameter(name)
            if p.shape != first.shape:
                raise ValueError(
                    f"after tensor parallelism, tied {names[0]} is {tuple(first.shape)} but "
                    f"{name} is {tuple(p.shape)}: shard both alike in the plan (embedding "
                    "'vocab' and output layer 'colwise' split the vocabulary the same way)")
            mod_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(mod_name), attr, first)
