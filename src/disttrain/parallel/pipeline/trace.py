"""Cut an unmodified model into pipeline stages from its traced graph.

For a model that does not name its layers (no `pipeline_layers()`: a Hugging Face model,
a nanoGPT copy), as torch.distributed.pipelining's `pipeline()` does: the model is traced
once on an example micro-batch with `torch.export` (non-strict; FX's symbolic trace fails
on Hugging Face forwards, see docs/design/model-parallelism.md), into one flat graph of
ATen ops whose nodes record the module they came from (`nn_module_stack`). The repeated
blocks (the largest ModuleList/Sequential of same-typed modules, or the `layers` given)
are cut into contiguous parts by `split.partition`; every node goes to the stage of its
block, code before the first block to the first stage and code after a block to that
block's stage (so the loss the model computes lands on the last stage). Values that do
not depend on the inputs or on trained weights (position ids, a causal mask, rotary
tables) are recomputed by every stage that uses them. Exactly one tensor may cross each
cut (the hidden state): that is what the runtime sends.

A stage is an `fx.GraphModule` holding the model's own Parameter objects under their
own names (the name used on that stage, for a weight tied across stages), so DP, ZeRO,
tied weights, checkpoints and `full_state_dict` see the model's names. Shapes are those of
the example micro-batch (the runtime keeps them fixed too). Pure: no process talks here.
"""

from __future__ import annotations

import inspect

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from disttrain.parallel.pipeline.split import layer_costs, partition

__all__ = ["repeated_blocks", "trace_stages"]


def repeated_blocks(model: nn.Module) -> list[str]:
    """Names of the largest ModuleList/Sequential of same-typed modules, in order."""
    best: list[str] = []
    for name, mod in model.named_modules():
        kids = list(mod._modules.values()) if isinstance(mod, (nn.ModuleList, nn.Sequential)) else []
        if len(kids) >= 2 and len({type(k) for k in kids}) == 1 and len(kids) > len(best):
            best = [f"{name}.{k}" if name else k for k in mod._modules]
    if not best:
        raise TypeError(f"found no repeated blocks in {type(model).__name__} to cut a pipeline "
                        "between (no ModuleList/Sequential of two or more same-typed modules); "
                        "give layers=[module names in forward order]")
    return best


def _export(model: nn.Module, x, target, target_arg: str | None):
    kwargs = {target_arg: target} if target_arg else {}
    params = inspect.signature(model.forward).parameters
    if "use_cache" in params:  # NOTE: Hugging Face: a KV cache object cannot be traced
        kwargs["use_cache"] = False
    try:
        return torch.export.export(model, (x,), kwargs, strict=False).module()
    except Exception as exc:  # noqa: BLE001 - re-raised with the construct and the fix
        raise TypeError(
            f"cannot pipeline {type(model).__name__} by tracing: torch.export failed with "
            f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}. Make that construct "
            "traceable (data-dependent Python control flow, untraceable output types), or "
            "define pipeline_layers() and a forward that skips missing layers "
            "(disttrain.models.GPT)") from exc


def _stage_of_nodes(gm: fx.GraphModule, block_stage: dict[str, int]) -> dict[fx.Node, int]:
    """Stage of every node that computes (placeholders and get_attr are placed later)."""
    out, current = {}, 0
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        paths = [v[0] for v in node.meta.get("nn_module_stack", {}).values()]
        hits = [block_stage[p] for p in paths if p in block_stage]
        if hits:
            current = hits[0]
        out[node] = current
    return out


def _free_nodes(gm: fx.GraphModule, trained: set[str]) -> set[fx.Node]:
    """Nodes computed from constants and buffers only (no input, no trained weight)."""
    free: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            if node.target not in trained:
                free.add(node)
        elif node.op in ("call_function", "call_method") and not _updates_state(node) and \
                all(n in free for n in node.all_input_nodes):
            free.add(node)
    return free


def _updates_state(node: fx.Node) -> bool:
    """An in-place op on a model buffer (BatchNorm's num_batches_tracked += 1)."""
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and target._schema.is_mutable and bool(node.args)
            and isinstance(node.args[0], fx.Node) and node.args[0].op == "get_attr")


def _needed(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes the output or a buffer update depends on (drops assertions, dead ends)."""
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    seen, todo = set(), [out_node] + [n for n in gm.graph.nodes if _updates_state(n)]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


def _stage_graph(gm, model: nn.Module, nodes: list[fx.Node], inputs: dict[fx.Node, str],
                 outputs: list[fx.Node], rename: dict[str, str]) -> fx.GraphModule:
    """A GraphModule of `nodes` (in graph order) taking `inputs` (node -> argument name)
    and returning `outputs` (one: that tensor; several: a tuple)."""
    graph, env = fx.Graph(), {}
    for node, arg in inputs.items():
        env[node] = graph.placeholder(arg)
    attrs = {}
    for node in nodes:
        if node in inputs or node.op in ("placeholder", "output"):
            continue
        if node.op == "get_attr":
            target = rename.get(node.target, node.target)
            env[node] = graph.get_attr(target)
            attrs[target] = _fetch(gm, node.target)
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[o] for o in outputs))
    stage = fx.GraphModule(attrs, graph, class_name="TracedStage")
    _keep_tp_layout(stage, model, attrs)
    return stage


def _keep_tp_layout(stage: fx.GraphModule, model: nn.Module, attrs: dict) -> None:
    """A traced stage's modules are plain; give each the tensor-parallel layout of the
    model's module it stands for (shard dim, fused blocks), which full_state_dict and
    clip_grad_norm_ read."""
    for path in {t.rpartition(".")[0] for t in attrs}:
        try:
            orig = model.get_submodule(path)
        except AttributeError:
            continue
        if callable(getattr(orig, "shard_dim", None)):
            sub = stage.get_submodule(path)
            sub.shard_dim, sub.fused = orig.shard_dim, getattr(orig, "fused", 1)


def _fetch(gm: nn.Module, target: str):
    *path, attr = target.split(".")
    mod = gm
    for p in path:
        mod = getattr(mod, p)
    return getattr(mod, attr)


def trace_stages(model: nn.Module, example: tuple, target_arg: str | None, num_stages: int,
                 stage: int, num_virtual: int = 1, layers: list[str] | None = None,
                 costs: list[float] | None = None) -> tuple[list[nn.Module], dict[str, int]]:
    """This stage's chunks (chunk c = virtual stage c * num_stages + stage) and the owner
    map (module name -> stage) of `model` traced on `example` = (inputs, targets), one
    micro-batch. Raises TypeError naming the construct when a cut cannot be made."""
    names = list(layers) if layers is not None else repeated_blocks(model)
    costs = layer_costs(model, names) if costs is None else list(costs)
    parts = num_stages * num_virtual
    ranges = partition(costs, parts)
    gm = _export(model, example[0], example[1], target_arg)
    block_stage = {n: v for v, (a, b) in enumerate(ranges) for n in names[a:b]}
    missing = [n for n in names if not any(n == v[0] for node in gm.graph.nodes
                                            for v in node.meta.get("nn_module_stack", {}).values())]
    if missing:
        raise TypeError(f"layers {missing[:3]} run no operation in {type(model).__name__}'s "
                        "traced forward; name modules that forward calls, in order")
    at = _stage_of_nodes(gm, block_stage)
    trained = {n for n, p in gm.named_parameters(remove_duplicate=False) if p.requires_grad}
    free, needed = _free_nodes(gm, trained), _needed(gm)
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    x_node, t_node = holders[0], next((n for n in holders if n.name == target_arg), None)
    cross = _crossings(gm, at, free, needed, parts, x_node, t_node)
    aliases = _aliases(model)
    chunks, owner = [], {}
    for v in range(parts):
        stage_nodes = _closure(gm, {n for n in needed if at.get(n) == v and n not in free},
                               free, trained)
        rename = _rename(stage_nodes, at, v, gm, aliases)
        for node in stage_nodes:
            if node.op == "get_attr" and node.target in trained:
                owner[rename.get(node.target, node.target).rpartition(".")[0]] = v % num_stages
        if v % num_stages != stage:
            continue
        inputs = {x_node: x_node.name} if v == 0 else {cross[v]: "x"}
        if v == parts - 1 and t_node is not None:
            inputs[t_node] = target_arg
        outputs = _outputs(gm, at, v) if v == parts - 1 else [cross[v + 1]]
        ordered = [n for n in gm.graph.nodes if n in stage_nodes or n in outputs]
        chunks.append(_stage_graph(gm, model, ordered, inputs, outputs, rename))
    return chunks, dict(sorted(owner.items(), key=lambda kv: -len(kv[0])))


def _crossings(gm, at, free, needed, parts, x_node, t_node) -> dict[int, fx.Node]:
    """The one tensor that crosses each cut v (from stages < v to stages >= v)."""
    out_node = next(n for n in gm.graph.nodes if n.op == "output")

    def user_stage(u):
        return parts - 1 if u is out_node else at.get(u, 0)

    for holder, ok, what in ((x_node, lambda s: s == 0, "the input"),
                             (t_node, lambda s: s == parts - 1, "the targets")):
        late = [u.name for u in (holder.users if holder is not None else [])
                if u in needed and not ok(user_stage(u))]
        if late:
            raise TypeError(f"{what} ({holder.name}) is used inside the pipeline at {late[:3]}; "
                            "a traced pipeline gives the input to the first stage and the "
                            "targets to the last only: compute what needs them there")
    cross = {}
    for v in range(1, parts):
        values = sorted({n.name for n in needed if n in at and n not in free and at[n] < v
                         and any(user_stage(u) >= v for u in n.users if u in needed)})
        if len(values) != 1:
            raise TypeError(f"the cut before pipeline part {v} passes {len(values)} tensors "
                            f"({values[:4]}); a stage sends one tensor to the next. Cut where "
                            "only the hidden state crosses: give layers=[...] (whole blocks)")
        cross[v] = next(n for n in gm.graph.nodes if n.name == values[0])
    return cross


def _closure(gm, nodes: set, free: set, trained: set) -> set:
    """`nodes` with the weights they read and the free values they need, recomputed."""
    out, todo = set(nodes), list(nodes)
    while todo:
        for n in todo.pop().all_input_nodes:
            if n not in out and (n in free or (n.op == "get_attr" and n.target in trained)):
                out.add(n)
                todo.append(n)
    return out


def _aliases(model: nn.Module) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(name)
    return out


def _rename(stage_nodes, at, v, gm, aliases) -> dict[str, str]:
    """A weight tied across stages goes by the name of the module that uses it here."""
    rename = {}
    for node in stage_nodes:
        names = aliases.get(id(_fetch(gm, node.target)), []) if node.op == "get_attr" else []
        if len(names) < 2:
            continue
        paths = {p[0] for u in node.users if at.get(u) == v
                 for p in u.meta.get("nn_module_stack", {}).values()}
        mine = [n for n in names if n.rpartition(".")[0] in paths]
        if mine:
            rename[node.target] = mine[0]
    return rename


def _outputs(gm, at, last: int) -> list[fx.Node]:
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    leaves = [n for n in pytree.tree_leaves(out_node.args[0]) if isinstance(n, fx.Node)]
    early = [n.name for n in leaves if at.get(n, last) != last]
    if early:
        raise TypeError(f"the model returns {early[:3]}, computed before the last pipeline "
                        "stage; a traced pipeline returns only what the last stage computes")
    return leaves
