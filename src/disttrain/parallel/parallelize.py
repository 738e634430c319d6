"""Hybrid parallelism: apply TP, then PP, then DP or ZeRO to a model over a `Mesh`.

The GPT-3 layout of the user's documents (pipeline stages, data-parallel replicas of
each stage, tensor parallelism inside a machine), composed as torchtitan's
`parallelize_llama` is: `parallelize(model, mesh, plan, config)` validates the options
(`Parallelism`, config.py) and calls the public steps with plain values, in order:
`survey` (what the later steps read from the untouched model), `apply_tp` (tensor/),
`split_stages` (with recompute), `tie_stages`,
`apply_data_parallel` (steps.py), then `Pipeline` (pipeline/); the `ParallelModel` is
built once, complete. A user can write the same chain by hand (README, "The chain").

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
from disttrain.parallel.parallel_model import ChunkOptimizers, ParallelModel, param_info
from disttrain.parallel.pipeline.runtime import Pipeline
from disttrain.parallel.pipeline.schedules import make_schedule
from disttrain.parallel.pipeline.tied import TiedWeights
from disttrain.parallel.steps import apply_data_parallel, split_stages, survey, tie_stages
from disttrain.parallel.sync_batchnorm import convert_sync_batchnorm
from disttrain.parallel.tensor import apply_tp

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
    pp, stage, tp = mesh.size("pp"), mesh.local_rank("pp"), mesh.size("tp")
    actions = make_schedule(cfg.schedule, pp, cfg.microbatches, cfg.num_virtual)  # checks first
    s = survey(model, pp * cfg.num_virtual, tied=cfg.tied, layers=cfg.layers, costs=cfg.costs,
               loss_given=cfg.loss_fn is not None)  # NOTE: first, the untouched model
    if cfg.sync_batchnorm:  # NOTE: before TP, so every later step sees the synced layers
        convert_sync_batchnorm(model, mesh.group("dp"))
    if tp > 1:  # NOTE: TP first: it must see whole layers
        apply_tp(model, mesh, plan, sequence_parallel=cfg.sequence_parallel, tied=s.tied)
    # NOTE: after TP (the loss follows what the plan did to the output layer), before
    # the stage split (the output layer is found in the whole model)
    loss_fn = cfg.loss_fn or default_loss(model, mesh.group("tp") if tp > 1 else None,
                                          s.target_arg)
    chunks, owner = split_stages(model, mesh, num_virtual=cfg.num_virtual, layers=cfg.layers,
                                 costs=s.costs, recompute=cfg.recompute,
                                 example=cfg.example_microbatch(), target_arg=s.target_arg)
    info = [param_info(c) for c in chunks]  # before ZeRO stage 3 removes the parameters
    tw = tie_stages(chunks, mesh, owner, s.tied)
    chunks = [apply_data_parallel(c, mesh.group("dp"), **_dp_keywords(cfg, tw, c)) for c in chunks]
    if cfg.zero:  # NOTE: tied copies sum their shard gradients; the loss is scaled
        tw.use_zero(chunks)
        loss_fn = _scaled_loss(loss_fn, chunks, cast=cfg.loss_fn is None and s.target_arg is None)
    pipe = Pipeline(chunks, actions[stage], stage, pp, cfg.microbatches, loss_fn,
                    group=mesh.group("pp"), ranks=mesh.peers("pp"), track_memory=cfg.track_memory,
                    tied=tw if tw.sets else None, device=s.device, target_arg=s.target_arg)
    return ParallelModel(chunks, pipe, mesh, s.shapes, owner, info, tied=tw, aliases=s.aliases,
                         optimizer=_build_optimizer(chunks, cfg))


def _dp_keywords(cfg: Parallelism, tw: TiedWeights, chunk: nn.Module) -> dict:
    """apply_data_parallel's keywords for one chunk: the config's (config.py says which
    wrapper takes which); for ZeRO also fp16's overflow vote over the whole job (Mesh spans
    the world) and this chunk's tied copies in buffers of their own."""
    opts = cfg.data_parallel_keywords()
    if not cfg.zero:
        return opts
    mine = {id(p) for p in chunk.parameters()}
    opts.update(overflow_group=dist.group.WORLD,
                separate=[p for p, _, _, _ in tw.sets if id(p) in mine])
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
