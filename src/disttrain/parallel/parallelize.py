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
reduce-scatter gradients, all-gather parameters).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from disttrain.comm import ops
from disttrain.mesh import Mesh
from disttrain.parallel.pipeline.runtime import Pipeline
from disttrain.parallel.pipeline.schedules import make_schedule
from disttrain.parallel.pipeline.split import _layer_names, layer_costs, partition, split_model
from disttrain.parallel.pipeline.tied import TiedWeights, build_tied, retie, tied_names
from disttrain.parallel.recompute import apply_recompute, recompute_names
from disttrain.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_tp,
    vocab_parallel_cross_entropy,
)
from disttrain.parallel.zero import Zero
from disttrain.parallel.zero.optimizer import vote_overflow

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


class ParallelModel(nn.Module):
    """This rank's share of a model: its stage chunks (TP shards, maybe DP-wrapped).

    `parameters()` are the local TP shards (give them to any torch optimizer) when
    zero=0; with ZeRO use `.optimizer` (over this rank's dp shards), which parallelize
    builds from `optimizer_factory`. `train_step(x, y)` runs the pipeline schedule;
    `full_state_dict()` reassembles the whole model on global rank 0.
    """

    def __init__(self, chunks, pipeline: Pipeline, mesh: Mesh, full_shapes: dict, owner: dict,
                 info: list[dict] | None = None):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.pipeline, self.mesh = pipeline, mesh
        self._full, self._owner = full_shapes, owner
        self._info = info or [_param_info(c) for c in self.local_modules()]
        self.optimizer = None  # set by parallelize when it builds one
        self._tied, self._aliases = TiedWeights([]), {}  # set by parallelize
        self._counted = [_counted_ranges(c, i, mesh.local_rank("tp") == 0)
                         for c, i in zip(self.chunks, self._info) if isinstance(c, Zero)]

    def train_step(self, inputs, targets) -> torch.Tensor:
        """Forward + backward of one batch (this dp replica's share). Blocks.

        Leaves averaged gradients in `.grad`; returns the loss averaged over dp replicas,
        the same on every rank.
        """
        loss = self.pipeline.step(inputs, targets)
        fp16 = [c.optimizer for c in self.chunks if isinstance(c, Zero) and c.optimizer.scaler]
        for opt in fp16:  # NOTE: the last stage scaled the loss; every stage's scale is equal
            opt.mark_scaled()
        if fp16:
            loss = loss / fp16[0].loss_scale
        if self.mesh.size("dp") > 1:
            ops.all_reduce(loss, group=self.mesh.group("dp"))
            loss /= self.mesh.size("dp")
        return loss

    def forward(self, x):
        if len(self.chunks) != 1 or self.mesh.size("pp") != 1:
            raise RuntimeError("a pipelined model runs through train_step(x, y), not forward()")
        return self.chunks[0](x)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so the whole model's gradient norm is at most `max_norm`.

        Same rule as torch.nn.utils.clip_grad_norm_ on the unsharded model: sharded
        parameters count on every tp rank, replicated ones (LayerNorm, row-parallel
        bias) once; squares are summed over the tp and pp groups (dp replicas already
        hold averaged, equal gradients). Returns the total norm. Blocks.
        """
        if self._counted:
            return self._clip_zero(max_norm)
        sq = torch.zeros((), dtype=torch.float32, device=self.pipeline.device)
        tp_first = self.mesh.local_rank("tp") == 0
        seen = set(self._tied.secondary)  # NOTE: a tied weight counts once, on one stage
        for chunk in self.local_modules():
            for mod in chunk.modules():
                for name, p in mod.named_parameters(recurse=False):
                    if id(p) in seen:
                        continue
                    seen.add(id(p))
                    if p.grad is not None and (tp_first or _shard_dim(mod, name) is not None):
                        sq += p.grad.float().pow(2).sum()
        for axis in ("tp", "pp"):
            if self.mesh.size(axis) > 1:
                ops.all_reduce(sq, group=self.mesh.group(axis))
        norm = sq.sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.dtype))
        return norm

    @torch.no_grad()
    def _clip_zero(self, max_norm: float) -> torch.Tensor:
        """clip_grad_norm_ over ZeRO shards: dp ranks hold disjoint pieces, summed too."""
        sq = torch.zeros((), dtype=torch.float32, device=self.pipeline.device)
        zeros = [c for c in self.chunks if isinstance(c, Zero)]
        # NOTE: one fp16 overflow vote for all chunks (the world votes once per step)
        if vote_overflow([z.optimizer for z in zeros]):
            return torch.tensor(float("inf"))  # the step will be skipped on every rank
        grads = [z.optimizer.grads_to_step() for z in zeros]  # unscaled fp32 masters if mixed
        skip = self._tied.secondary  # NOTE: a tied weight counts once, on one stage
        for z, counted, gs in zip(zeros, self._counted, grads):
            for g, ranges, seg in zip(gs, counted, z.engine.segments()):
                if g is not None and not (len(seg[2]) == 1 and seg[2][0][0] in skip):
                    sq += sum((g[a:b].float().pow(2).sum() for a, b in ranges),
                              torch.zeros((), device=sq.device))
        for axis in ("dp", "tp", "pp"):
            if self.mesh.size(axis) > 1:
                ops.all_reduce(sq, group=self.mesh.group(axis))
        norm = sq.sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in (g for gs in grads for g in gs if g is not None):
            g.mul_(coef.to(g.dtype))
        return norm

    def local_modules(self) -> list[nn.Module]:
        """The stage chunks without their DataParallel/Zero wrapper (full-model names)."""
        return [getattr(c, "module", c) for c in self.chunks]

    @torch.no_grad()
    def full_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """The unsharded parameters (or their gradients), on CPU, on global rank 0; {} elsewhere.

        A tied weight appears under each of its names, one tensor (as in state_dict()).
        Collective over the whole mesh: every rank must call it. Blocks.
        """
        local = self._unshard_tp(grads)  # name -> full tensor of this stage
        out: dict[str, torch.Tensor] = {}
        rank, shape = self.mesh.rank, self.mesh.shape
        for i, name in enumerate(self._full):
            src = shape.rank_at(pp=self._stage_of(name), dp=0, tp=0)
            full_shape, dtype = self._full[name]
            # NOTE: in the model's dtype as given: ZeRO mixed precision casts it after we
            # recorded it, and sender and receiver must agree on the bytes.
            if rank == src == 0:
                out[name] = local[name].to(dtype).cpu().clone()
            elif rank == src:
                ops.send(local[name].to(dtype).contiguous(), 0, tag=i)
            elif rank == 0:
                buf = torch.empty(full_shape, dtype=dtype, device=self.pipeline.device)
                ops.recv(buf, src, tag=i)
                out[name] = buf.cpu()
        if rank == 0:
            out.update({alias: out[name] for alias, name in self._aliases.items()})
        return out

    def _stage_of(self, name: str) -> int:
        return _stage_of(self._owner, name)

    def _unshard_tp(self, grads: bool) -> dict[str, torch.Tensor]:
        group, tp = self.mesh.group("tp"), self.mesh.size("tp")
        out = {}
        for chunk, info in zip(self.chunks, self._info):
            if isinstance(chunk, Zero):
                local = _unshard_zero(chunk, info, grads, self.mesh.group("dp"))
            else:
                local = {id(p): p.grad if grads else p for p in chunk.parameters()}
            for pid, (name, shape, dim) in info.items():
                t = local.get(pid)
                t = torch.zeros(shape, device=self.pipeline.device) if t is None else t.detach()
                if dim is not None and tp > 1:
                    parts = [torch.empty_like(t) for _ in range(tp)]
                    ops.all_gather(parts, t.contiguous(), group=group)
                    t = torch.cat(parts, dim=dim)
                out[name] = t
        return out


class ChunkOptimizers:
    """The ZeRO optimizers of several stage chunks (interleaved pipeline) as one.

    step() and zero_grad() run each in chunk order (they block, like ZeroOptimizer's);
    `param_groups` lists every chunk's groups, so an lr change reaches all of them.
    """

    def __init__(self, optimizers: list):
        self.optimizers = list(optimizers)

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def loss_scale(self) -> float:
        return self.optimizers[0].loss_scale

    @property
    def last_step_skipped(self) -> bool:
        return self.optimizers[0].last_step_skipped

    def step(self) -> None:
        vote_overflow(self.optimizers)  # NOTE: fp16: one vote, every chunk skips alike
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return {"chunks": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict.get("chunks", [])
        if len(saved) != len(self.optimizers):
            raise ValueError(f"optimizer state has {len(saved)} chunk(s), this stage "
                             f"{len(self.optimizers)}; load it with the same pipeline layout")
        for o, sd in zip(self.optimizers, saved):
            o.load_state_dict(sd)


def _stage_of(owner: dict, name: str) -> int:
    """The pipeline stage holding parameter `name` (owner: layer name -> stage)."""
    for layer, stage in owner.items():
        if name.startswith(layer + "."):
            return stage
    return 0


def _param_info(chunk: nn.Module) -> dict[int, tuple[str, torch.Size, int | None]]:
    """id(param) -> (full-model name, local shape, tp shard dim or None) of a stage chunk."""
    info = {}
    for mod_name, mod in chunk.named_modules():
        for p_name, p in mod.named_parameters(recurse=False):
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            info.setdefault(id(p), (name, p.shape, _shard_dim(mod, p_name)))
    return info


def _counted_ranges(z: Zero, info: dict, tp_first: bool) -> list[list[tuple[int, int]]]:
    """Per ZeRO shard: the (a, b) slices whose squares count in the norm on this tp rank.

    TP-sharded parameters count on every tp rank, replicated ones on tp rank 0 only.
    """
    out = []
    for lo, hi, segs in z.engine.segments():
        ranges = []
        for pid, off, numel in segs:
            a, b = max(lo, off), min(hi, off + numel)
            if a < b and pid in info and (tp_first or info[pid][2] is not None):
                ranges.append((a - lo, b - lo))
        out.append(ranges)
    return out


@torch.no_grad()
def _unshard_zero(z: Zero, info: dict, grads: bool, group) -> dict[int, torch.Tensor]:
    """id(param) -> this tp rank's full local tensor, all-gathered over dp. Blocks."""
    if grads:
        z.optimizer._prepare()  # NOTE: averaged gradients, as DataParallel leaves them
    world, out = dist.get_world_size(group), {}
    for shard, g, (_, _, segs) in zip(z.engine.shard_parameters(), z.engine.shard_grads(),
                                      z.engine.segments()):
        t = g if grads else shard
        t = torch.zeros_like(shard) if t is None else t.detach()
        flat = torch.empty(t.numel() * world, dtype=t.dtype, device=t.device)  # (bucket,)
        ops.all_gather(list(flat.chunk(world)), t.contiguous(), group=group)
        for pid, off, numel in segs:
            out[pid] = flat[off:off + numel].view(info[pid][1])
    return out


def _shard_dim(mod: nn.Module, param: str) -> int | None:
    if isinstance(mod, (ColumnParallelLinear, VocabParallelEmbedding)):
        return 0
    if isinstance(mod, RowParallelLinear) and param == "weight":
        return 1
    return None
