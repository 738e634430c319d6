"""The model `parallelize` returns: one rank's stage chunks, stepped, clipped, reassembled.

`ParallelModel` holds this rank's share of the model (TP shards cut into pipeline stage
chunks, each maybe wrapped in DataParallel or Zero) and does what needs the whole model:
`train_step` runs the pipeline schedule (runtime.py) and averages the loss over dp;
`clip_grad_norm_` computes the unsharded model's gradient norm (torch's rule) from the
shards; `full_state_dict` reassembles the unsharded parameters on global rank 0.
`ChunkOptimizers` steps the ZeRO optimizers of several chunks (interleaved pipeline) as
one. The helpers at the bottom (`param_info`, `_counted_ranges`, `_unshard_zero`,
`_shard_dim`, `stage_of`) map local shards back to full-model names, shapes and slices.

Who talks to whom: clip_grad_norm_ all-reduces a squared norm over the tp and pp groups
(ZeRO: dp too, and fp16's overflow vote over the world, zero/optimizer.py);
full_state_dict all-gathers TP shards over tp (ZeRO shards over dp first), then each
stage's (dp=0, tp=0) rank sends its tensors point to point to global rank 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from disttrain.comm import ops
from disttrain.dtypes import accumulation_dtype, scale_, sum_of_squares
from disttrain.mesh import Mesh
from disttrain.parallel.pipeline.runtime import Pipeline
from disttrain.parallel.pipeline.tied import TiedWeights
from disttrain.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from disttrain.parallel.zero import Zero
from disttrain.parallel.zero.optimizer import vote_overflow

__all__ = ["ParallelModel", "ChunkOptimizers", "param_info", "stage_of"]


class ParallelModel(nn.Module):
    """This rank's share of a model: its stage chunks (TP shards, maybe DP-wrapped).

    `parameters()` are the local TP shards (give them to any torch optimizer) when
    zero=0; with ZeRO use `.optimizer` (over this rank's dp shards), which parallelize
    builds from `optimizer_factory`. `train_step(x, y)` runs the pipeline schedule;
    `full_state_dict()` reassembles the whole model on global rank 0.
    """

    def __init__(self, chunks, pipeline: Pipeline, mesh: Mesh, full_shapes: dict, owner: dict,
                 info: list[dict] | None = None, tied: TiedWeights | None = None,
                 aliases: dict[str, str] | None = None, optimizer=None):
        """chunks: this stage's chunks (maybe DataParallel/Zero-wrapped); pipeline: runs
        them; full_shapes: name -> (shape, dtype) of the unsharded model; owner: layer
        name -> pipeline stage; info: per chunk, `param_info` taken before ZeRO stage 3;
        tied: copies of weights tied across stages; aliases: tied name -> first name;
        optimizer: what `.optimizer` is (ZeRO's, or one built over the local shards)."""
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.pipeline, self.mesh = pipeline, mesh
        self._full, self._owner = full_shapes, owner
        self._info = info or [param_info(c) for c in self.local_modules()]
        self.optimizer = optimizer
        self._tied, self._aliases = tied or TiedWeights([]), dict(aliases or {})
        # NOTE: the one place that asks which chunks ZeRO shards; the rest reads _zero
        self._zero = {id(c) for c in self.chunks if isinstance(c, Zero)}
        self._counted = [_counted_ranges(c, i, mesh.local_rank("tp") == 0)
                         for c, i in zip(self.chunks, self._info) if id(c) in self._zero]
        # NOTE: from the whole model's dtypes, so every rank's all-reduce agrees
        self._norm_dtype = accumulation_dtype(*(dtype for _, dtype in full_shapes.values()))

    @property
    def aliases(self) -> dict[str, str]:
        """Tied weight name -> the first name of that weight (its name in checkpoints)."""
        return dict(self._aliases)

    def train_step(self, inputs, targets) -> torch.Tensor:
        """Forward + backward of one batch (this dp replica's share). Blocks.

        Leaves averaged gradients in `.grad`; returns the loss averaged over dp replicas,
        the same on every rank.
        """
        loss = self.pipeline.step(inputs, targets)
        fp16 = [z.optimizer for z in self._zeros() if z.optimizer.scaler]
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
        hold averaged, equal gradients), in the model's dtype (fp16/bf16: fp32). Returns
        the total norm. Blocks.
        """
        if self._counted:
            return self._clip_zero(max_norm)
        tp_first = self.mesh.local_rank("tp") == 0
        seen = set(self._tied.secondary)  # NOTE: a tied weight counts once, on one stage
        counted = []
        for chunk in self.local_modules():
            for mod in chunk.modules():
                for name, p in mod.named_parameters(recurse=False):
                    if id(p) in seen:
                        continue
                    seen.add(id(p))
                    if p.grad is not None and (tp_first or _shard_dim(mod, name) is not None):
                        counted.append(p.grad)
        sq = sum_of_squares(counted, self._norm_dtype, self.pipeline.device)
        for axis in ("tp", "pp"):
            if self.mesh.size(axis) > 1:
                ops.all_reduce(sq, group=self.mesh.group(axis))
        norm = sq.sqrt()
        scale_([p.grad for p in self.parameters() if p.grad is not None],
               (max_norm / (norm + 1e-6)).clamp(max=1.0))
        return norm

    @torch.no_grad()
    def _clip_zero(self, max_norm: float) -> torch.Tensor:
        """clip_grad_norm_ over ZeRO shards: dp ranks hold disjoint pieces, summed too."""
        zeros = self._zeros()
        # NOTE: one fp16 overflow vote for all chunks (the world votes once per step)
        if vote_overflow([z.optimizer for z in zeros]):
            return torch.tensor(float("inf"))  # the step will be skipped on every rank
        grads = [z.optimizer.grads_to_step() for z in zeros]  # unscaled fp32 masters if mixed
        skip = self._tied.secondary  # NOTE: a tied weight counts once, on one stage
        pieces = []
        for z, counted, gs in zip(zeros, self._counted, grads):
            for g, ranges, seg in zip(gs, counted, z.engine.segments()):
                if g is not None and not (len(seg.pieces) == 1 and seg.pieces[0].param_id in skip):
                    pieces += [g[a:b] for a, b in ranges]
        sq = sum_of_squares(pieces, self._norm_dtype, self.pipeline.device)
        for axis in ("dp", "tp", "pp"):
            if self.mesh.size(axis) > 1:
                ops.all_reduce(sq, group=self.mesh.group(axis))
        norm = sq.sqrt()
        scale_([g for gs in grads for g in gs if g is not None],
               (max_norm / (norm + 1e-6)).clamp(max=1.0))
        return norm

    def _zeros(self) -> list[Zero]:
        """The chunks ZeRO shards, in chunk order."""
        return [c for c in self.chunks if id(c) in self._zero]

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
        return stage_of(self._owner, name)

    def _unshard_tp(self, grads: bool) -> dict[str, torch.Tensor]:
        group, tp = self.mesh.group("tp"), self.mesh.size("tp")
        out = {}
        for chunk, info in zip(self.chunks, self._info):
            if id(chunk) in self._zero:
                local = _unshard_zero(chunk, info, grads, self.mesh.group("dp"))
            else:
                local = {id(p): p.grad if grads else p for p in chunk.parameters()}
            for pid, (name, shape, dim, fused) in info.items():
                t = local.get(pid)
                t = torch.zeros(shape, device=self.pipeline.device) if t is None else t.detach()
                if dim is not None and tp > 1:
                    parts = [torch.empty_like(t) for _ in range(tp)]
                    ops.all_gather(parts, t.contiguous(), group=group)
                    # NOTE: a fused layer's shard is its slice of each block: regroup by block
                    blocks = [p.chunk(fused, dim) for p in parts]
                    t = torch.cat([b[k] for k in range(fused) for b in blocks], dim=dim)
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


def stage_of(owner: dict, name: str) -> int:
    """The pipeline stage holding parameter `name` (owner: layer name -> stage)."""
    for layer, stage in owner.items():
        if name.startswith(layer + "."):
            return stage
    return 0


def param_info(chunk: nn.Module) -> dict[int, tuple[str, torch.Size, int | None, int]]:
    """id(param) -> (full-model name, local shape, tp shard dim or None, fused blocks) of a
    stage chunk."""
    info = {}
    for mod_name, mod in chunk.named_modules():
        for p_name, p in mod.named_parameters(recurse=False):
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            info.setdefault(id(p), (name, p.shape, _shard_dim(mod, p_name),
                                    getattr(mod, "fused", 1)))
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
        z.optimizer.prepare()  # NOTE: averaged gradients, as DataParallel leaves them
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
    if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
        return mod.shard_dim(param)
    if isinstance(mod, VocabParallelEmbedding):
        return 0
    # NOTE: a traced stage's plain submodule carries its TP layer's shard_dim (trace.py)
    shard_dim = getattr(mod, "shard_dim", None)
    return shard_dim(param) if callable(shard_dim) else None
