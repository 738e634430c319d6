"""Hybrid parallelism: apply TP, then PP, then DP or ZeRO to a model over a `Mesh`.

The GPT-3 layout of the user's documents (pipeline stages, data-parallel replicas of
each stage, tensor parallelism inside a machine), composed as torchtitan does:
`parallelize(model, mesh, plan, config)` is a linear chain of steps that each take
groups and plain values (apply TP, apply recompute, split stages, tie stages, apply DP
or ZeRO, build the pipeline), and the `ParallelModel` is built once, complete. Options
live in `Parallelism` (config.py); keyword arguments are a shorthand that builds it.

NOTE: the order is fixed: TP must see whole layers; PP cuts the sharded model by layer;
DP/ZeRO must see one stage's final shards (docs/design/model-parallelism.md says why,
and how fp16's overflow vote and sequence parallelism fit in).

Who talks to whom: tp groups all-reduce inside layers (Megatron f/g), pp groups exchange
activations and gradients point to point, dp groups all-reduce gradient buckets (ZeRO:
reduce-scatter gradients, all-gather parameters).
"""

from __future__ import annotations

import copy

import torch.distributed as dist
from torch import nn

from disttrain.dtypes import upcast_half
from disttrain.mesh import Mesh
from disttrain.parallel.config import Parallelism
from disttrain.parallel.default_loss import default_loss, token_loss
from disttrain.parallel.model_loss import target_arg
from disttrain.parallel.parallel_model import ChunkOptimizers, ParallelModel, param_info, stage_of
from disttrain.parallel.pipeline.recompute_traced import recompute_regions
from disttrain.parallel.pipeline.runtime import Pipeline
from disttrain.parallel.pipeline.schedules import make_schedule
from disttrain.parallel.pipeline.split import layer_costs, layer_names, partition, split_model
from disttrain.parallel.pipeline.tied import TiedWeights, build_tied, retie, tied_names
from disttrain.parallel.pipeline.trace import repeated_blocks, trace_stages
from disttrain.parallel.recompute import apply_recompute, recompute_names
from disttrain.parallel.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm
from disttrain.parallel.tensor import apply_tp, plan_for
from disttrain.parallel.zero import Zero

__all__ = ["parallelize", "token_loss", "ParallelModel", "ChunkOptimizers", "Parallelism"]


def parallelize(model: nn.Module, mesh: Mesh, plan=None,
                config: Parallelism | None = None, **options) -> ParallelModel:
    """Shard `model` over `mesh`: TP (plan), PP (schedule, micro-batches), DP or ZeRO. Blocks.

    Every rank passes the same, identically initialised model. `config` (a
    `disttrain.Parallelism`) says how; keyword options are a shorthand for its fields
    (`parallelize(m, mesh, plan, zero=2, optimizer_factory=...)`), not both. The result's
    `train_step(x, y)` runs the pipeline schedule; `.optimizer` is set when zero > 0 or
    `optimizer_factory` is given (ZeRO's holds only this rank's dp shard). Without
    `loss_fn` the loss follows the output layer (default_loss.py): the model's own loss
    if it takes the targets, else the vocab-parallel cross-entropy when the plan shards
    the output layer column-wise, the plain one when it is whole; ValueError if unclear.
    """
    if config is not None and options:
        raise TypeError("pass either config=Parallelism(...) or keyword options, not both")
    cfg = config if config is not None else Parallelism.from_options(options)
    pp, tp, stage = mesh.size("pp"), mesh.size("tp"), mesh.local_rank("pp")
    actions = make_schedule(cfg.schedule, pp, cfg.microbatches, cfg.num_virtual)  # checks first
    # NOTE: a model that does not name its layers is cut from its traced graph (trace.py)
    traced = pp * cfg.num_virtual > 1 and not hasattr(model, "pipeline_layers")
    names = layer_names(model, cfg.layers) if pp * cfg.num_virtual > 1 and not traced else []
    costs = layer_costs(model, names) if names and cfg.costs is None else cfg.costs
    full = {n: (p.shape, p.dtype) for n, p in model.named_parameters()}
    tied = tied_names(model, cfg.tied)
    # NOTE: a model that takes the targets computes its own loss, unless loss_fn is given
    arg = target_arg(model) if cfg.loss_fn is None else None
    device = next(model.parameters()).device
    # NOTE: TP first (it must see whole layers), then recompute (wraps the sharded layers),
    # then the stage split, then DP/ZeRO (it must see one stage's final shards).
    if cfg.sync_batchnorm:
        convert_sync_batchnorm(model, mesh.group("dp"))
    if tp > 1:
        _apply_tp(model, mesh, plan, cfg.sequence_parallel, tied)
    tp_group = mesh.group("tp") if tp > 1 else None
    # NOTE: after TP (the loss follows what the plan did to the output layer), before
    # the stage split (the output layer is found in the whole model)
    loss_fn = cfg.loss_fn or default_loss(model, tp_group, arg)
    if cfg.recompute and not traced:  # NOTE: a traced stage checkpoints its graph (below)
        apply_recompute(model, recompute_names(model, cfg.recompute))
    if traced:
        chunks, owner = _trace_stages(model, mesh, cfg, arg)
    else:
        chunks, owner = _split_stages(model, mesh, stage, cfg.num_virtual, names, costs)
    info = [param_info(c) for c in chunks]  # before ZeRO stage 3 removes the parameters
    tw = _tie_stages(chunks, tied, owner, mesh)
    chunks, loss_fn = _apply_data_parallel(chunks, mesh, cfg, tw, loss_fn,
                                           cast=cfg.loss_fn is None and arg is None)
    pipe = Pipeline(chunks, actions[stage], stage, pp, cfg.microbatches, loss_fn,
                    group=mesh.group("pp"), ranks=mesh.peers("pp"), track_memory=cfg.track_memory,
                    tied=tw if tw.sets else None, device=device, target_arg=arg)
    aliases = {n: names_[0] for names_ in tied for n in names_[1:]}
    optimizer = _build_optimizer(chunks, cfg)
    return ParallelModel(chunks, pipe, mesh, full, owner, info, tied=tw, aliases=aliases,
                         optimizer=optimizer)


def _apply_tp(model: nn.Module, mesh: Mesh, plan, sequence_parallel: bool,
              tied: list[list[str]]) -> None:
    """Shard the plan's modules over tp, in place; tied names share one shard again.
    plan="auto": the ready plan for a Hugging Face model (tensor/plans.py)."""
    if not plan:
        raise ValueError("tp > 1 needs a plan, e.g. GPT.tp_plan, plan='auto' for a Hugging "
                         "Face GPT-2 or Llama, or {'mlp.fc': 'colwise', ...}")
    if plan == "auto":
        plan = plan_for(model)
    apply_tp(model, mesh, plan, sequence_parallel=sequence_parallel)
    retie(model, tied)  # NOTE: TP cloned each tied name into its own shard


def _split_stages(model: nn.Module, mesh: Mesh, stage: int, num_virtual: int,
                  names: list[str], costs) -> tuple[list[nn.Module], dict[str, int]]:
    """This stage's chunks and the owner map (layer name -> stage); the model whole at pp=1."""
    if not names:
        return [model], {}
    pp = mesh.size("pp")
    chunks = split_model(model, pp, stage, num_virtual, names, costs)
    ranges = partition(costs, pp * num_virtual)
    return chunks, {n: v % pp for v, (a, b) in enumerate(ranges) for n in names[a:b]}


def _trace_stages(model: nn.Module, mesh: Mesh, cfg: Parallelism, arg: str | None):
    """This stage's chunks cut from the model's traced graph, and the owner map."""
    if cfg.example is None:
        raise ValueError(f"{type(model).__name__} has no pipeline_layers(), so parallelize "
                         "traces it: pass example=(x, y), a batch as train_step gets it")
    if any(isinstance(m, SyncBatchNorm) for m in model.modules()):
        raise ValueError("a traced pipeline does not combine with SyncBatchNorm (torch.export "
                         "cannot trace its all-reduce); use sync_batchnorm=False (each dp "
                         "replica normalizes its own micro-batch), or pp=1")
    if cfg.sequence_parallel:
        raise ValueError("a traced pipeline does not combine with sequence parallelism (its "
                         "collectives are not traceable operators); use sequence_parallel="
                         "False, or define pipeline_layers() and a forward that skips "
                         "missing layers (disttrain.models.GPT)")
    x, y = (t.chunk(cfg.microbatches)[0] for t in cfg.example)
    chunks, owner = trace_stages(model, (x, y if arg else None), arg, mesh.size("pp"),
                                 mesh.local_rank("pp"), cfg.num_virtual, cfg.layers, cfg.costs)
    if cfg.recompute:  # True: the blocks the pipeline is cut between
        regions = (recompute_names(model, cfg.recompute) if cfg.recompute is not True
                   else list(cfg.layers or repeated_blocks(model)))
        for chunk in chunks:
            recompute_regions(chunk, regions)
    return chunks, owner


def _tie_stages(chunks, tied, owner: dict, mesh: Mesh) -> TiedWeights:
    """Copies of weights tied across stages: their groups, made equal now. Blocks."""
    tw = build_tied(chunks, tied, lambda name: stage_of(owner, name), mesh)
    tw.broadcast_()  # NOTE: identical seeds make them equal already; this makes it certain
    return tw


def _apply_data_parallel(chunks: list, mesh: Mesh, cfg: Parallelism, tw: TiedWeights, loss_fn,
                         cast: bool):
    """Wrap each chunk in Zero (zero >= 1) or DataParallel (dp > 1); returns the chunks
    and the loss the last stage backpropagates (ZeRO mixed precision: at least fp32,
    scaled). cast: loss_fn is the default token loss (its logits upcast from fp16/bf16)."""
    if cfg.zero:
        chunks = [Zero(c, cfg.optimizer_factory, stage=cfg.zero, group=mesh.group("dp"),
                       **_zero_options(cfg, tw, c)) for c in chunks]
        tw.use_zero(chunks)
        return chunks, _scaled_loss(loss_fn, chunks, cast)
    if mesh.size("dp") > 1:
        from disttrain.parallel.data_parallel import DataParallel

        chunks = [DataParallel(c, group=mesh.group("dp"), **cfg.data_parallel_options())
                  for c in chunks]
    return chunks, loss_fn


def _zero_options(cfg: Parallelism, tw: TiedWeights, chunk: nn.Module) -> dict:
    """Zero's keywords: the config's, fp16's overflow vote over the whole job (Mesh spans
    the world), and this chunk's tied copies in buffers of their own."""
    mine = {id(p) for p in chunk.parameters()}
    opts = {**cfg.zero_options(), "overflow_group": dist.group.WORLD,
            "separate": [p for p, _, _, _ in tw.sets if id(p) in mine]}
    if opts["loss_scaler"] is not None:  # NOTE: one scaler per chunk, each updated once
        opts["loss_scaler"] = copy.deepcopy(opts["loss_scaler"])
    return opts


def _scaled_loss(base, chunks: list, cast: bool):
    """The loss ZeRO mixed precision backpropagates: fp16/bf16 upcast to fp32 (cast: the
    logits before the default token loss too; wider dtypes kept), and (fp16) times the
    loss scale, every stage's scale equal."""
    if chunks[0].dtype is None:
        return base
    opt = chunks[0].optimizer

    def scaled(out, y):
        before = opt.loss_scaled
        loss = upcast_half(base(upcast_half(out) if cast else out, y))
        if opt.scaler is not None and opt.loss_scaled and not before:
            raise ValueError("loss_fn scaled the loss itself (optimizer.scale_loss): under "
                             "parallelize return the plain fp32 loss, e.g. "
                             "lambda out, y: loss(out.float(), y); parallelize scales it")
        return opt.scale_loss(loss)
    return scaled


def _build_optimizer(chunks: list, cfg: Parallelism):
    """ZeRO's optimizers (one per chunk, stepped as one), or one over the local shards."""
    if cfg.zero:
        opts = [c.optimizer for c in chunks]
        return opts[0] if len(opts) == 1 else ChunkOptimizers(opts)
    if cfg.optimizer_factory is not None:
        return cfg.optimizer_factory(list(nn.ModuleList(chunks).parameters()))  # tied: once
    return None
