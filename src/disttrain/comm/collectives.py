"""Thin helpers over torch.distributed collectives that several strategies share.

Group-aware: a `group` is any ProcessGroup (None = the default world group), and
ranks passed in are *group* ranks, translated to the global ranks torch.distributed
wants. Device-neutral: tensors stay on their own device (gloo on CPU, NCCL on CUDA).
Collectives go through comm/ops.py, so they are recorded and a hang names them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.distributed as dist

from disttrain.comm import ops
from disttrain.compiling import not_traced

__all__ = ["group_rank", "group_size", "global_rank", "broadcast_tensors"]


def group_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank inside `group` (-1 when it is not a member)."""
    return dist.get_rank(group)


def group_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group)


def global_rank(group: dist.ProcessGroup | None, rank_in_group: int) -> int:
    """Global rank of `rank_in_group` in `group` (identity for the world group)."""
    if group is None or group is dist.group.WORLD:
        return rank_in_group
    return dist.get_global_rank(group, rank_in_group)


@not_traced  # NOTE: host-side (recorded) collectives; under compile, outside the graph
@torch.no_grad()
def broadcast_tensors(tensors: Sequence[torch.Tensor], src_in_group: int = 0,
                      group: dist.ProcessGroup | None = None) -> None:
    """Overwrite `tensors` everywhere with the copies on group rank `src_in_group`.

    Blocks until done. Tensors are flattened into one buffer per (dtype, device), so
    a model costs a few collectives, not one per tensor. Every group member must pass
    tensors of the same shapes, dtypes and order.
    """
    src = global_rank(group, src_in_group)
    by_kind: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        by_kind[(t.dtype, t.device)].append(t)
    for members in by_kind.values():
        flat = torch.cat([t.detach().reshape(-1) for t in members])  # (sum numel,)
        ops.broadcast(flat, src=src, group=group)
        offset = 0
        for t in members:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
