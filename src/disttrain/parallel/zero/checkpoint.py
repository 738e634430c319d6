"""ZeRO optimizer state as per-parameter pieces, so checkpoints reshard.

A ZeRO rank's optimizer state covers flat chunks that cut across parameters, chunked by
stage, world size and buckets. For `disttrain.Checkpointer`'s `sharded_state_dict()`
protocol (docs/design/checkpoints.md) every state tensor is re-described per parameter
name (`state.<name>.exp_avg`, global shape (numel,), this rank's piece a view of the real
state), plus `state.<name>.master` and `loss_scaler` in mixed precision, so a checkpoint
saved at world 2, stage 1 loads at world 4, stage 3 or into a plain optimizer.
`materialize` gives a fresh optimizer state tensors to load into (one zero-gradient step
at lr 0, then zeroed). Details: docs/design/zero.md, "Optimizer state".

Who talks to whom: ZeroOptimizer delegates here; the engines say which parameter
ranges each shard parameter holds (`segments()`); no communication.
"""

from __future__ import annotations

from typing import Any

import torch

from disttrain.checkpoint.modules import FLAT_BY_NAME, materialize, restore_param_groups
from disttrain.checkpoint.reshard import ShardedTensor

__all__ = ["full_flat", "load_sharded_state", "sharded_state"]


def _pieces(segments, names):
    """(shard index, name, numel, offset in param, lo, hi in shard) for each param here."""
    for j, (lo, hi, members) in enumerate(segments):
        for pid, off, numel in members:
            a, b = max(lo, off), min(hi, off + numel)
            yield j, names[pid], numel, (a - off if a < b else 0), (a - lo, b - lo) if a < b else (0, 0)


def sharded_state(opt: torch.optim.Optimizer, shards, segments, names,
                  masters=None) -> dict[str, Any]:
    """{'param_groups': hyperparameters, 'state': {name: {key: piece or scalar}}}.
    `masters` (mixed precision): the fp32 master of each shard, saved as key 'master'."""
    materialize(opt)  # NOTE: the optimizer was built over exactly `shards`
    out: dict[str, dict[str, Any]] = {}
    for j, name, numel, at, (a, b) in _pieces(segments, names):
        st = out.setdefault(name, {})
        items = dict(opt.state[shards[j]])
        if masters is not None:
            items["master"] = masters[j].detach()
        for key, v in items.items():
            if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == shards[j].numel():
                if key not in st or st[key].local.numel() == 0:
                    st[key] = ShardedTensor(v[a:b], (numel,), (at,))
            elif key not in st:
                st[key] = v  # replicated: scalar step counts and the like
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return {"format": FLAT_BY_NAME, "param_groups": groups, "state": dict(sorted(out.items()))}


def load_sharded_state(opt: torch.optim.Optimizer, shards, segments, names,
                       tree: dict[str, Any]) -> None:
    """After the checkpointer filled the pieces in place: replicated values, hyperparams."""
    restore_param_groups(opt, tree, "build it with the same factory")
    for j, name, _, _, _ in _pieces(segments, names):
        for key, v in tree["state"].get(name, {}).items():
            if isinstance(v, ShardedTensor) or key == "master":
                continue
            cur = opt.state[shards[j]].get(key)
            if isinstance(cur, torch.Tensor) and isinstance(v, torch.Tensor):
                cur.copy_(v)
            else:
                opt.state[shards[j]][key] = v


@torch.no_grad()
def full_flat(shards, segments, shapes, names, group, stats,
              gather: bool) -> dict[str, torch.Tensor]:
    """{name: full tensor} from every rank's flat `shards`. With `gather` (stages 1-3)
    blocks: one all-gather per shard; stage 0 shards already hold whole buffers."""
    from disttrain.parallel.zero import comm

    world = torch.distributed.get_world_size(group)
    out = {}
    for s, (_, _, members) in zip(shards, segments):
        flat = s.detach()
        if gather:
            flat = torch.empty(world * s.numel(), dtype=s.dtype, device=s.device)
            comm.all_gather(flat, s.detach(), group, stats)
        for pid, off, numel in members:
            out[names[pid]] = flat[off:off + numel].view(shapes[pid]).clone()
    return out
