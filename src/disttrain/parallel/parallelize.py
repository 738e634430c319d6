"""Hybrid parallelism: apply TP, then PP, then DP or ZeRO to a model over a `Mesh`.

The GPT-3 layout the user's documents describe (pipeline stages, data-parallel replicas
of each stage, tensor parallelism inside a machine), as torchtitan composes it: one
short function, each strategy applied from outside to a model with no distributed code.

NOTE: the order is fixed. TP first, because it swaps modules inside layers and must see
the whole model (tied weights are re-tied to one shard right after, recompute wrappers
go around the sharded layers); then PP, which cuts the (sharded) model into stage chunks
by layer (a weight tied across stages gets one copy per stage, pipeline/tied.py); then DP, which wraps each chunk so its gradients are averaged over the mesh's dp group
(after the chunk's last backward of the step, not after every micro-batch).
NOTE: with zero=k > 0 the dp step is `Zero(chunk, stage=k, group=mesh.group("dp"))`
instead of DataParallel, still last: ZeRO flattens (stage 3: removes) the parameters it
is given, so it must see the final TP shards of one stage chunk; each (pp, tp) coordinate
shards its own chunk over its dp peers. ZeRO keeps gradient *sums* until the step, so
every micro-batch's backward reduces (no no_sync) and the sums accumulate correctly.
NOTE: with sequence_parallel=True, TP also hooks the Parameters that see a sequence
shard (LayerNorms, row-parallel biases) so that their gradients are summed over tp inside
backward, before accumulation: DP's/ZeRO's reduction and the tied sum, which read `.grad`
later, see whole gradients (sequence_parallel.py); ZeRO stage 3 (no such Parameters left)
is refused.
NOTE (ZeRO mixed precision): fp16's overflow vote spans the whole job (every pp stage and
tp rank, not only the dp group: Megatron/DeepSpeed reduce found_inf over the model-parallel
world), one vote per step however many chunks a stage holds, so every rank skips alike and
the loss scales stay equal; parallelize scales the loss itself (loss_fn returns the plain
fp32 loss) and train_step returns it unscaled; clip_grad_norm_ clips the unscaled fp32
master gradients, so max_norm means what it means in fp32.

Who talks to whom: tp groups allreduce inside layers (Megatron f/g), pp groups exchange
activations and gradients point to point, dp groups allreduce gradient buckets (ZeRO:
reduce-scatter gradients, all-gather parameters). The result is a `ParallelModel`
(parallel_model.py: train_step, clip_grad_norm_, full_state_dict).
"""

from __future__ import annotations

import copy

import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from disttrain.mesh import Mesh
from disttrain.parallel.parallel_model import (  # re-exported: callers import them from here
    ChunkOptimizers,
    ParallelModel,
    _param_info,
    _stage_of,
)
from disttrain.parallel.pipeline.runtime import Pipeline
from disttrain.parallel.pipeline.schedules import make_schedule
from disttrain.parallel.pipeline.split import _layer_names, layer_costs, partition, split_model
from disttrain.parallel.pipeline.tied import TiedWeights, build_tied, retie, tied_names
from disttrain.parallel.recompute import apply_recompute, recompute_names
from disttrain.parallel.tensor_parallel import apply_tp, vocab_parallel_cross_entropy
from disttrain.parallel.zero import Zero

__all__ = ["parallelize", "ParallelModel", "ChunkOptimizers"]


def token_loss(group=None):
    """Mean token cross-entropy of logits (B, T, V) — or (B, T, V/tp), vocab-sharded."""
    if group is not None and dist.get_world_size(group) > 1:
        return lambda logits, y: vocab_parallel_cross_entropy(logits, y, group)
    return lambda logits, y: F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def parallelize(model: nn.Module, mesh: Mesh, plan: dict[str, str] | None = None,
                schedule: str = "1f1b", microbatches: int = 1, num_virtual: int = 1,
                loss_fn=None, layers: list[str] | None = None, costs: list[float] | None = None,
                dp_options: dict | None = None, track_memory: bool = False, zero: int = 0,
                optimizer_factory=None, recompute=False, tied=None,
                sequence_parallel: bool = False) -> ParallelModel:
    """Shard `model` over `mesh`: TP (plan), PP (schedule, micro-batches), DP or ZeRO. Blocks.

    Every rank passes the same, identically initialised model. `loss_fn(output, target)`
    runs on the last pipeline stage; by default it is token cross-entropy, vocab-parallel
    over the tp group when tp > 1 (the output layer colwise in the plan, as in
    GPT.tp_plan). `zero`: 0 plain DataParallel over dp; 1-3 ZeRO stage over dp (needs
    `optimizer_factory`, params -> torch optimizer; use `.optimizer` of the result).
    `optimizer_factory` with zero=0 builds a plain optimizer over the local shards.
    `dp_options` go to DataParallel (bucket_mb, compression, ...) or Zero (bucket_mb).
    `recompute`: True (the model's `recompute_layers()`) or module names/globs whose
    activations are recomputed in backward (recompute.py). `tied`: sets of parameter
    names sharing one weight; by default `model.tied_parameters()` or the Parameters
    the model holds under several names; copies on different stages are kept equal.
    `sequence_parallel`: with tp > 1, activations outside the tp layers are split along
    the sequence over the tp group (Megatron-LM's sequence parallelism; the plan's
    "sequence*" entries, as in GPT.tp_plan; the sequence length must divide by tp).
    """
    pp, tp, dp = mesh.size("pp"), mesh.size("tp"), mesh.size("dp")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0 (DataParallel) or a ZeRO stage 1, 2 or 3; got {zero!r}")
    if sequence_parallel and tp > 1 and zero == 3:
        raise ValueError("sequence_parallel sums LayerNorm gradients over tp in hooks on the "
                         "Parameters, which ZeRO stage 3 replaces by flat units; use zero=1 "
                         "or 2 with sequence_parallel, or sequence_parallel=False")
    if zero and optimizer_factory is None:
        raise ValueError(f"zero={zero} shards the optimizer state, so parallelize builds the "
                         "optimizer: pass optimizer_factory=lambda ps: torch.optim.AdamW(ps, "
                         "lr=...) and step model.optimizer")
    actions = make_schedule(schedule, pp, microbatches, num_virtual)  # checks before any work
    names = _layer_names(model, layers) if pp * num_virtual > 1 else []
    costs = layer_costs(model, names) if names and costs is None else costs
    full = {n: (p.shape, p.dtype) for n, p in model.named_parameters()}
    tied = tied_names(model, tied)
    if tp > 1:
        if not plan:
            raise ValueError("tp > 1 needs a plan, e.g. GPT.tp_plan or {'mlp.fc': 'colwise', ...}")
        apply_tp(model, mesh, plan, sequence_parallel=sequence_parallel)
        retie(model, tied)  # NOTE: TP cloned each tied name into its own shard
    if recompute:
        apply_recompute(model, recompute_names(model, recompute))
    stage = mesh.local_rank("pp")
    if names:
        chunks = split_model(model, pp, stage, num_virtual, names, costs)
        ranges = partition(costs, pp * num_virtual)
        owner = {n: v % pp for v, (a, b) in enumerate(ranges) for n in names[a:b]}
    else:
        chunks, owner = [model], {}
    info = [_param_info(c) for c in chunks]  # before ZeRO stage 3 removes the parameters
    tw = _tie_stages(chunks, tied, owner, mesh, zero)
    device = next(model.parameters()).device
    if zero:
        chunks = [Zero(c, optimizer_factory, stage=zero, group=mesh.group("dp"),
                       **_zero_options(dp_options, tw, c)) for c in chunks]
        tw.use_zero(chunks)
        loss_fn = _scaled_loss(loss_fn, chunks, mesh.group("tp") if tp > 1 else None)
    elif dp > 1:
        from disttrain.parallel.data_parallel import DataParallel

        chunks = [DataParallel(c, group=mesh.group("dp"), **(dp_options or {})) for c in chunks]
    pipe = Pipeline(chunks, actions[stage], stage, pp, microbatches,
                    loss_fn or token_loss(mesh.group("tp") if tp > 1 else None),
                    group=mesh.group("pp"), ranks=mesh.peers("pp"), track_memory=track_memory,
                    tied=tw if tw.sets else None)
    pipe.device = device  # NOTE: a stage-3 chunk has no parameter to read the device from
    pm = ParallelModel(chunks, pipe, mesh, full, owner, info)
    pm._tied = tw
    pm._aliases = {n: names_[0] for names_ in tied for n in names_[1:]}
    if zero:
        opts = [c.optimizer for c in chunks]
        pm.optimizer = opts[0] if len(opts) == 1 else ChunkOptimizers(opts)
    elif optimizer_factory is not None:
        pm.optimizer = optimizer_factory(list(pm.parameters()))
    return pm


def _tie_stages(chunks, tied, owner: dict, mesh: Mesh, zero: int) -> TiedWeights:
    """Copies of weights tied across stages: their groups, made equal now. Blocks."""
    def stage_of(name):
        return _stage_of(owner, name)
    tw = build_tied(chunks, tied, stage_of, mesh)
    tw.broadcast_()  # NOTE: identical seeds make them equal already; this makes it certain
    return tw


def _zero_options(dp_options: dict | None, tw: TiedWeights, chunk: nn.Module) -> dict:
    """Zero's keywords: the user's dp_options, fp16's overflow vote over the whole job
    (Mesh spans the world), and this chunk's tied copies in buffers of their own."""
    mine = {id(p) for p in chunk.parameters()}
    opts = {"overflow_group": dist.group.WORLD, **(dp_options or {}),
            "separate": [p for p, _, _, _ in tw.sets if id(p) in mine]}
    if opts.get("loss_scaler") is not None:  # NOTE: one scaler per chunk, each updated once
        opts["loss_scaler"] = copy.deepcopy(opts["loss_scaler"])
    return opts


def _scaled_loss(loss_fn, chunks: list, tp_group):
    """The loss ZeRO mixed precision backpropagates: computed in fp32 by default, and
    (fp16) times the loss scale, every stage's scale being equal."""
    base = loss_fn or token_loss(tp_group)
    if chunks[0].dtype is None:
        return loss_fn
    opt, cast = chunks[0].optimizer, loss_fn is None

    def scaled(out, y):
        before = opt._scaled
        loss = base(out.float() if cast else out, y)
        if opt.scaler is not None and opt._scaled and not before:
            raise ValueError("loss_fn scaled the loss itself (optimizer.scale_loss): under "
                             "parallelize return the plain fp32 loss, e.g. "
                             "lambda out, y: loss(out.float(), y); parallelize scales it")
        return opt.scale_loss(loss)
    return scaled
