"""The split backward that runs the zero-bubble schedule ZB-H1 (schedules.py has the schedule).

Qi et al. 2023, "Zero Bubble Pipeline Parallelism" (arXiv 2401.10241), as
torch.distributed.pipelining runs it (BACKWARD_INPUT / BACKWARD_WEIGHT): B computes the
gradient w.r.t. the stage input (on the critical path, sent upstream at once) and records
the gradients reaching the nodes where weight branches leave the input's path; W later
walks only those branches for the weight gradients.

Who talks to whom: runtime.py calls `backward_input` for B and `backward_weight` for W;
both are local autograd calls (no communication). Unlike torch's, W accumulates through
AccumulateGrad, so DataParallel's and ZeRO's post-accumulate-grad hooks fire once per
parameter per micro-batch. Schedule and bubble: docs/design/model-parallelism.md,
"Pipeline".
"""

from __future__ import annotations

import collections

import torch
from torch.autograd.graph import GradientEdge

__all__ = ["backward_input", "backward_weight", "check_split_backward"]


def backward_input(out: torch.Tensor, x: torch.Tensor, grad: torch.Tensor | None,
                   params: list | None = None):
    """B: d(out)/d(x) times `grad` (None when `out` is the loss), keeping the graph for W.

    Returns (input gradient, W plan). With `params`, the plan holds, for each group of
    parameters, the gradients that reached the nodes of x's path feeding them (as torch's
    stage_backward_input), so W walks only the weight branches; the plan is None (W walks
    the whole graph again) when x needs no gradient (the first stage's token ids) or a
    parameter does not hang off x's path. Weights' `.grad` and their hooks are untouched:
    autograd.grad accumulates nothing. Blocks (local compute).
    """
    if not x.requires_grad:
        return None, None
    groups = _param_groups(out, x, params) if params else None
    handles = []
    for g in groups or []:
        g["grads"] = [None] * len(g["nodes"])
        for k, node in enumerate(g["nodes"]):
            handles.append(node.register_prehook(_capture(g["grads"], k)))
    try:
        (gx,) = torch.autograd.grad(out, [x], grad, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return gx, groups


def backward_weight(out: torch.Tensor, grad: torch.Tensor | None, params: list,
                    plan: list | None = None) -> None:
    """W: accumulate d(out)/d(params) times `grad` into `.grad`. Blocks (local compute).

    NOTE: each parameter's AccumulateGrad runs once here, so post-accumulate-grad hooks
    fire once per parameter per micro-batch, as with a whole backward (unlike torch's
    stage_backward_weight, which assigns `.grad`). With a plan from backward_input, one
    autograd run per parameter group starts at the captured gradients (weight branches
    only); without one, one run walks the graph again from `out` (about a whole
    backward), which is what a hook that must see a single backward (DataParallel's
    synced W, ZeRO's reduction) gets.
    """
    if not params:  # NOTE: a chunk without parameters has no W; dropping `out` frees the graph
        return
    if plan is None:
        torch.autograd.backward(out, grad, inputs=params)
        return
    for g in plan:
        edges = [(GradientEdge(n, i), t) for n, gs in zip(g["nodes"], g["grads"])
                 for i, t in enumerate(gs or ()) if t is not None]
        # NOTE: a node reached from another of the group takes its captured gradient,
        # not a second contribution (no double counting)
        handles = [n.register_prehook(lambda _go, saved=gs: saved)
                   for n, gs in zip(g["nodes"], g["grads"])] if len(g["nodes"]) > 1 else []
        try:
            if edges:
                torch.autograd.backward([e for e, _ in edges], [t for _, t in edges],
                                        inputs=g["params"])
        finally:
            for h in handles:
                h.remove()


def check_split_backward(chunks: list) -> list[bool]:
    """Refuse what a split backward (B now, W later) is not known to compose with; per
    chunk, whether its W must be one autograd run.

    A module says so itself, so this package names no wrapper (ZeRO, recompute):
    `split_backward_refusal` (a message, or None) refuses the split backward over it;
    `whole_weight_backward` (True) asks for one autograd run per W (ZeRO 1/2 reduce in
    their hooks).
    """
    for c in chunks:
        for m in c.modules():
            refusal = getattr(m, "split_backward_refusal", None)
            if refusal:
                raise ValueError(refusal)
    return [bool(getattr(c, "whole_weight_backward", False)) for c in chunks]


def _capture(store: list, k: int):
    def hook(grad_outputs):
        store[k] = grad_outputs
    return hook


def _node(t: torch.Tensor):
    """A tensor's grad_fn, or for a leaf its AccumulateGrad node."""
    return t.grad_fn if t.grad_fn is not None else t.view_as(t).grad_fn.next_functions[0][0]


def _param_groups(out: torch.Tensor, x: torch.Tensor, params: list) -> list[dict] | None:
    """Parameters grouped by the nodes of x's path their gradients leave it at.

    Returns [{"params": [...], "nodes": [...]}], groups sharing no node, or None when a
    parameter is not below x's path (W then walks the whole graph).
    """
    rev: dict = collections.defaultdict(list)  # node -> nodes that feed it gradients
    todo, seen = [out.grad_fn], {out.grad_fn}
    while todo:
        node = todo.pop()
        for nxt, _ in node.next_functions:
            if nxt is not None:
                rev[nxt].append(node)
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
    on_path = _upward(rev, [_node(x)], set())[0]  # every node x's gradient passes
    owner: dict = {}  # node of x's path -> group (dict), merged when shared
    groups: list[dict] = []
    for p in params:
        acc = _node(p)
        if acc not in seen:
            continue  # unused by this chunk's output: no gradient, as a whole backward
        hits = _upward(rev, [acc], on_path)[1]
        if not hits:
            return None
        mine = {id(owner[n]): owner[n] for n in hits if n in owner}
        g = {"params": [p], "nodes": [n for n in hits if n not in owner]}
        for other in mine.values():
            g["params"] += other["params"]
            g["nodes"] += other["nodes"]
            groups = [x for x in groups if x is not other]  # NOTE: by identity
        groups.append(g)
        for n in g["nodes"]:
            owner[n] = g
    return groups


def _upward(rev: dict, roots: list, stop: set) -> tuple[set, list]:
    """Nodes reachable from `roots` toward the output, not past `stop`; the `stop` hit."""
    closure, hits, todo = set(roots), [], list(roots)
    while todo:
        for up in rev[todo.pop()]:
            if up in stop:
                if up not in hits:
                    hits.append(up)
            elif up not in closure:
                closure.add(up)
                todo.append(up)
    return closure, hits
