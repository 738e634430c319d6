"""The steps `parallelize` composes, each public and taking plain arguments.

As torchtitan's `apply_tp` / `apply_ac` / `apply_fsdp` and its separate pipeline split,
a user can call any of them alone on a model of their own:

- `survey(model, parts, ...)`: what the later steps read from the whole model (shapes,
  tied names, the targets argument, stage costs), taken before any step changes it;
- `disttrain.parallel.tensor.apply_tp(model, mesh, plan)`: TP shards, in place;
- `apply_recompute(model, layers)` (recompute.py): activation recomputation, in place;
- `split_stages(model, mesh, ...)`: this rank's pipeline chunks and who owns each layer;
- `tie_stages(chunks, mesh, owner, tied)`: weights tied across stages kept equal;
- `apply_data_parallel(module, group, zero=...)`: DataParallel or a ZeRO stage;
- `disttrain.parallel.pipeline.Pipeline(chunks, actions, ...)`: runs a schedule.

NOTE: the order `parallelize` applies them in is fixed: the survey reads the untouched
model, TP must see whole layers, the stage split cuts the sharded model by layer, DP/ZeRO
must see one stage's final shards.

Who talks to whom: `split_stages` talks to no one; `tie_stages` creates each tied set's
stage group and broadcasts from its first stage; `apply_data_parallel` broadcasts the
module from dp rank 0 (the wrappers' construction).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from disttrain.mesh import Mesh
from disttrain.parallel.data_parallel import DataParallel
from disttrain.parallel.model_loss import target_arg
from disttrain.parallel.parallel_model import stage_of
from disttrain.parallel.pipeline.recompute_traced import recompute_regions
from disttrain.parallel.pipeline.split import layer_costs, layer_names, partition, split_model
from disttrain.parallel.pipeline.tied import TiedWeights, build_tied
from disttrain.parallel.pipeline.trace import repeated_blocks, trace_stages
from disttrain.parallel.recompute import apply_recompute, recompute_names
from disttrain.parallel.sync_batchnorm import SyncBatchNorm
from disttrain.parallel.tensor.tied import tied_names
from disttrain.parallel.zero import Zero

__all__ = ["Stages", "Survey", "apply_data_parallel", "split_stages", "stage_costs", "survey",
           "tie_stages"]


class Survey(NamedTuple):
    """What the steps need from the whole model, read before any of them changes it (TP
    shards layers, the split keeps one stage's, ZeRO stage 3 removes parameters)."""

    shapes: dict[str, tuple[torch.Size, torch.dtype]]
    """Full-model parameter name -> (shape, dtype) (ParallelModel gathers into these)."""
    tied: list[list[str]]
    """Sets of names sharing one weight (`tied_names`): apply_tp and tie_stages take it."""
    target_arg: str | None
    """The forward argument that takes the targets (the model computes its own loss), or
    None (also when the caller gives its own loss function)."""
    device: torch.device
    """Where the model's parameters are (the pipeline's buffers go there)."""
    costs: list[float] | None
    """Per-layer costs the stage split balances by (`stage_costs`, of whole layers)."""

    @property
    def aliases(self) -> dict[str, str]:
        """Each tied name after the first -> the first (a checkpoint keeps one copy)."""
        return {n: names[0] for names in self.tied for n in names[1:]}


def survey(model: nn.Module, parts: int = 1, *, tied: list[list[str]] | None = None,
           layers: list[str] | None = None, costs: list[float] | None = None,
           loss_given: bool = False) -> Survey:
    """Read `model` before the steps change it. Does not block.

    parts: pipeline virtual stages (pp * num_virtual); tied, layers: as `tied_names` and
    `split_stages` take them; costs: given costs (else `stage_costs`); loss_given: the
    caller brings its own loss function (then the model's own loss is not used).
    """
    shapes = {n: (p.shape, p.dtype) for n, p in model.named_parameters()}
    # NOTE: a model that takes the targets computes its own loss, unless a loss is given
    arg = None if loss_given else target_arg(model)
    costs = stage_costs(model, parts, layers) if costs is None else costs
    return Survey(shapes, tied_names(model, tied), arg, next(model.parameters()).device, costs)


class Stages(NamedTuple):
    """This rank's pipeline chunks (chunk c = virtual stage c * pp + stage) and the owner
    map (layer name -> pipeline stage; {} when the model is whole)."""

    chunks: list[nn.Module]
    owner: dict[str, int]


def _traced(model: nn.Module, parts: int) -> bool:
    """Whether `split_stages` cuts `model` from its traced graph: a pipeline of `parts` > 1
    virtual stages over a model without `pipeline_layers()`."""
    return parts > 1 and not hasattr(model, "pipeline_layers")


def stage_costs(model: nn.Module, parts: int, layers: list[str] | None = None) -> list[float] | None:
    """The per-layer costs `split_stages` balances by when cutting `model` into `parts`
    virtual stages by its named layers (parameter counts), None where it needs none.

    NOTE: parallelize takes them before TP, so stages balance the whole layers.
    """
    if parts == 1 or _traced(model, parts):
        return None
    return layer_costs(model, layer_names(model, layers))


def split_stages(model: nn.Module, mesh: Mesh, *, num_virtual: int = 1,
                 layers: list[str] | None = None, costs: list[float] | None = None,
                 recompute: bool | list[str] = False, example: tuple | None = None,
                 target_arg: str | None = None) -> Stages:
    """Cut `model` into this rank's pipeline chunks over the mesh's pp axis. Does not block.

    A model with `pipeline_layers()` (or given `layers`) is cut between those modules,
    each chunk an ordinary module holding the model's own parameters under their names; a
    model without is traced with torch.export on `example` = (inputs, targets) of one
    micro-batch and cut between its repeated blocks (`layers` to choose). At pp *
    num_virtual == 1 the model is the one chunk. `costs`: one per layer (default:
    parameter counts). `recompute`: as `apply_recompute`'s layers; applied here because a
    traced model is checkpointed in its graph (True: the blocks it is cut between).
    `target_arg`: the forward argument that takes the targets, for a traced model that
    computes its own loss.
    """
    pp, stage = mesh.size("pp"), mesh.local_rank("pp")
    parts = pp * num_virtual
    if _traced(model, parts):
        return _trace(model, mesh, num_virtual, layers, costs, recompute, example, target_arg)
    if recompute:
        apply_recompute(model, recompute)
    if parts == 1:
        return Stages([model], {})
    names = layer_names(model, layers)
    costs = layer_costs(model, names) if costs is None else list(costs)
    chunks = split_model(model, pp, stage, num_virtual, names, costs)
    ranges = partition(costs, parts)
    return Stages(chunks, {n: v % pp for v, (a, b) in enumerate(ranges) for n in names[a:b]})


def _trace(model, mesh, num_virtual, layers, costs, recompute, example, target_arg) -> Stages:
    """split_stages for a model without pipeline_layers(): cut from its traced graph."""
    if example is None:
        raise ValueError(f"{type(model).__name__} has no pipeline_layers(), so it is traced to "
                         "be cut into stages: pass example=(x, y), a batch as train_step gets "
                         "it (split_stages: one micro-batch)")
    if any(isinstance(m, SyncBatchNorm) for m in model.modules()):
        raise ValueError("a traced pipeline does not combine with SyncBatchNorm (torch.export "
                         "cannot trace its all-reduce); use sync_batchnorm=False (each dp "
                         "replica normalizes its own micro-batch), or pp=1")
    if any(getattr(m, "sequence_parallel", False) for m in model.modules()):
        raise ValueError("a traced pipeline does not combine with sequence parallelism (its "
                         "collectives are not traceable operators); use sequence_parallel="
                         "False, or define pipeline_layers() and a forward that skips "
                         "missing layers (disttrain.models.GPT)")
    x, y = example
    chunks, owner = trace_stages(model, (x, y if target_arg else None), target_arg,
                                 mesh.size("pp"), mesh.local_rank("pp"), num_virtual, layers,
                                 costs)
    if recompute:
        regions = (recompute_names(model, recompute) if recompute is not True
                   else list(layers or repeated_blocks(model)))
        for chunk in chunks:
            recompute_regions(chunk, regions)
    return Stages(chunks, owner)


def tie_stages(chunks: list[nn.Module], mesh: Mesh, owner: dict[str, int],
               tied: list[list[str]]) -> TiedWeights:
    """Weights tied across stages (`tied`: sets of parameter names, see
    `disttrain.parallel.tensor.tied_names`): their stage groups, every copy made equal to
    the first stage's. Collective over the world (every rank calls it). Blocks."""
    tw = build_tied(chunks, tied, lambda name: stage_of(owner, name), mesh)
    tw.broadcast_()  # NOTE: identical seeds make them equal already; this makes it certain
    return tw


def apply_data_parallel(module: nn.Module, group, zero: int = 0, optimizer_factory=None,
                        **options) -> nn.Module:
    """`module` replicated over `group`: zero=0 `DataParallel` (the module itself when the
    group has one rank), zero=1-3 that ZeRO stage (`Zero`, whose `.optimizer` is built from
    `optimizer_factory` over this rank's shard). `options` are the wrapper's keywords
    (bucket_mb, algorithm, precision, ...). Returns an ordinary module to call as `module`.
    Blocks (the module is broadcast from group rank 0)."""
    if zero:
        return Zero(module, optimizer_factory, stage=zero, group=group, **options)
    if optimizer_factory is not None:
        raise ValueError("optimizer_factory is for ZeRO (zero=1-3), which shards the optimizer; "
                         "with zero=0 build the optimizer over the returned module's parameters")
    if dist.get_world_size(group) == 1:
        return module
    return DataParallel(module, group=group, **options)
