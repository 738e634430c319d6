"""Activation recomputation inside a traced pipeline stage.

A traced stage (trace.py) is one flat graph, so the `Recompute` wrapper (recompute.py)
cannot wrap its layers: torch.export inlines `torch.utils.checkpoint` and drops it. Here
each chosen module's nodes (found by their `nn_module_stack`) are moved into a graph of
their own, taking every value they read (the weights included) as arguments, and the
stage calls it under `checkpoint(..., use_reentrant=False)`: as with `Recompute`, only
the region's inputs are kept and backward runs the region again. The piece holds no
weights (they stay the stage's attributes, under the model's names), so DataParallel,
ZeRO, tied weights and `full_state_dict` see the stage unchanged.

Refused with the reason: a region that updates a buffer (BatchNorm in training mode
would update its running statistics twice, once in the forward and once in the rerun).
Pure: no process talks here (a region's TP collectives run again in backward, in the same
order on every tp rank, as with `Recompute`).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["recompute_regions"]


class _Checkpointed(nn.Module):
    """Runs a weightless graph piece under non-reentrant checkpoint."""

    def __init__(self, piece: fx.GraphModule):
        super().__init__()
        self.piece = piece

    def forward(self, *args):
        return checkpoint(self.piece, *args, use_reentrant=False)


def _in_region(node: fx.Node, region: str) -> bool:
    return node.op == "call_function" and any(
        v[0] == region for v in node.meta.get("nn_module_stack", {}).values())


def _updates_buffer(node: fx.Node) -> bool:
    target = node.target
    if target is torch.ops.aten.batch_norm.default:
        return len(node.args) > 5 and node.args[5] is True and node.args[3] is not None
    return (isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable
            and bool(node.args) and isinstance(node.args[0], fx.Node)
            and node.args[0].op == "get_attr")


def recompute_regions(stage: fx.GraphModule, regions: list[str]) -> int:
    """Checkpoint each module of `regions` that runs on this traced `stage`, in place;
    returns how many. Raises ValueError for a region that updates a buffer."""
    count = 0
    for region in regions:
        nodes = [n for n in stage.graph.nodes if _in_region(n, region)]
        if nodes:
            _outline(stage, region, nodes, count)
            count += 1
    stage.graph.lint()
    stage.recompile()
    return count


def _outline(stage: fx.GraphModule, region: str, nodes: list[fx.Node], index: int) -> None:
    bad = [n.name for n in nodes if _updates_buffer(n)]
    if bad:
        raise ValueError(f"recompute of {region!r} would update buffers twice ({bad[:3]}: "
                         "BatchNorm running statistics in training mode); recompute modules "
                         "without BatchNorm, or recompute=False")
    inside = set(nodes)
    order = {n: i for i, n in enumerate(stage.graph.nodes)}
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
    late = [a.name for a in inputs if order[a] > order[nodes[0]]]
    if late:
        raise ValueError(f"cannot recompute {region!r}: its code is interleaved with other "
                         f"code ({late[:3]} computed in between); name a smaller module")
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    graph, env = fx.Graph(), {}
    for a in inputs:
        env[a] = graph.placeholder(a.name)
    for n in nodes:
        env[n] = graph.node_copy(n, lambda x: env[x])
    graph.output(tuple(env[o] for o in outputs))
    name = f"_recompute_{index}"
    stage.add_submodule(name, _Checkpointed(fx.GraphModule(nn.Module(), graph)))
    with stage.graph.inserting_before(nodes[0]):
        call = stage.graph.call_module(name, tuple(inputs))
        for k, out in enumerate(outputs):
            item = stage.graph.call_function(operator.getitem, (call, k))
            out.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)
    for n in reversed(nodes):
        stage.graph.erase_node(n)
