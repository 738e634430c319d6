"""Weights tied across pipeline stages: one copy per stage, kept equal (Megatron-LM).
Follows Megatron-LM's embedding group (Narayanan et al. 2021, arXiv 2104.04473).

Who talks to whom: the ranks of one embedding group (same dp and tp coordinate, first
and last stage); one broadcast at set-up and one all-reduce per tied weight per step.

More (the design and its reasons): docs/design/model-parallelism.md, "Notes from parallel/pipeline/tied.py".
"""

from __future__ import annotations

import torch
from torch import nn

from disttrain.comm import ops

__all__ = ["TiedWeights", "build_tied", "retie", "tied_names"]


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


class TiedWeights:
    """This rank's copies of weights tied across pipeline stages, and their groups.

    sets: [(local Parameter, group, source rank, primary)] where `primary` says this
    stage's copy is the one counted once (in a gradient norm); the copy on the first
    stage that holds the set is the source at init.
    """

    def __init__(self, sets: list[tuple[nn.Parameter, object, int, bool]],
                 first_names: dict[int, str] | None = None):
        self.sets = sets
        self.first_names = first_names or {}  # id(copy) -> the tied set's first name
        self._zero: dict[int, object] = {}  # id(copy) -> the Zero that shards it

    def use_zero(self, wrappers: list) -> None:
        """The copies live in these ZeRO wrappers (built with `separate=` the copies):
        sum their shard gradients instead of `.grad` (see the module NOTE), and key their
        optimizer state by the set's first name (`Zero.state_names`), as a plain optimizer's
        by-name state is (checkpoint/modules.py), so checkpoints move between layouts."""
        for p, _, _, _ in self.sets:
            for z in wrappers:
                if id(p) in z.param_shapes:
                    self._zero[id(p)] = z
                    z.state_names[id(p)] = self.first_names.get(id(p), z.param_names[id(p)])

    @property
    def secondary(self) -> set[int]:
        """ids of local copies that another stage's copy stands for (count once)."""
        return {id(p) for p, _, _, primary in self.sets if not primary}

    @torch.no_grad()
    def broadcast_(self) -> None:
        """Make every copy equal to the first stage's. Blocks (collective per set)."""
        for p, group, src, _ in self.sets:
            ops.broadcast(p.data, src, group=group)

    @torch.no_grad()
    def all_reduce_grads(self) -> None:
        """Sum each tied weight's gradient over its copies. Blocks (collective per set).

        NOTE: call after the dp reduction has finished (see module doc).
        """
        for p, group, _, _ in self.sets:
            z = self._zero.get(id(p))
            if z is not None:  # this rank's dp shard of the copy's gradient (waits for ZeRO)
                ops.all_reduce(z.separate_grad(p), group=group)
                continue
            if p.grad is None:  # a copy that got no gradient still joins the sum
                p.grad = torch.zeros_like(p)
            ops.all_reduce(p.grad, group=group)


def build_tied(chunks: list[nn.Module], tied: list[list[str]], stage_of, mesh) -> TiedWeights:
    """The TiedWeights of this rank: for each set held by more than one stage, create its
    stage group (collective: every rank calls this with the same sets) and find the
    local copy. `stage_of(name)` is the pipeline stage holding parameter `name`."""
    sets, first_names = [], {}
    for names in tied:
        stages = sorted({stage_of(n) for n in names})
        if len(stages) < 2:
            continue  # one stage: one Parameter object, its gradient accumulates itself
        group = mesh.stage_group(tuple(stages))
        stage = mesh.local_rank("pp")
        if stage not in stages:
            continue
        local = {n for n in names if stage_of(n) == stage}
        params = {id(p): p for c in chunks for n, p in c.named_parameters() if n in local}
        if len(params) != 1:
            raise ValueError(f"stage {stage} holds tied {sorted(local)} as {len(params)} "
                             "separate weights; tie them to one Parameter")
        src = mesh.shape.rank_at(pp=stages[0], dp=mesh.local_rank("dp"),
                                 tp=mesh.local_rank("tp"))
        copy = next(iter(params.values()))
        sets.append((copy, group, src, stage == stages[0]))
        first_names[id(copy)] = names[0]
    return TiedWeights(sets, first_names)
