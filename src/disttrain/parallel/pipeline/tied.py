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

__all__ = ["TiedWeights", "build_tied"]


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
