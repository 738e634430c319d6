"""Who writes what: the save plan every rank derives from the same gathered metadata.

Input: one JSON entry per rank (its step, its model/optimizer skeletons, and for each
tensor path `[dtype, global shape, offsets, shape, CRC-32 or None]`). Output: one merged
skeleton per object, the manifest's tensor table, which rank writes each distinct piece
(the lowest holding it), and the replicated tensors whose copies differ between ranks.
Every rank computes the same answer, so no further exchange is needed to agree on it.

Pure code: no processes, no files.
"""

from __future__ import annotations

from typing import Any

from disttrain.checkpoint import state
from disttrain.checkpoint.manifest import CheckpointError, Piece, TensorEntry
from disttrain.checkpoint.reshard import Slice, check_tiling

__all__ = ["merged_trees", "plan"]


def merged_trees(gathered: list[dict]) -> dict[str, Any]:
    """One skeleton per object from every rank's: the same step and objects everywhere;
    keys may differ (a pipeline stage holds its own layers), values may not."""
    steps = sorted({g["step"] for g in gathered})
    if len(steps) > 1:
        raise CheckpointError(f"ranks called save() with different steps {steps}; "
                              "every rank must save the same step")
    kinds = [sorted(g["trees"]) for g in gathered]
    if any(k != kinds[0] for k in kinds):
        raise CheckpointError(f"ranks passed different objects to save() ({kinds}); pass "
                              "model=/optimizer= on every rank")
    merged = dict(gathered[0]["trees"])
    for r, g in enumerate(gathered[1:], start=1):
        for key, tree in g["trees"].items():
            try:
                merged[key] = state.merge(merged[key], tree, key)
            except ValueError as err:
                raise CheckpointError(
                    f"rank {r} and a lower rank disagree on replicated {key} state at {err}. "
                    "Replicated values (hyperparameters, step counts) must be equal on every "
                    "rank; state that differs per rank (a sharded optimizer's) must be "
                    "declared through sharded_state_dict() (see docs/design/checkpoints.md)"
                ) from None
    return merged


def plan(gathered: list[dict], rank: int):
    """(manifest tensor table, {path: writer rank} for the pieces `rank` holds,
    {path: ranks whose 'replicated' copy differs from the lowest rank's}).

    Every rank computes the same plan from the same gathered data.
    """
    entries: dict[str, TensorEntry] = {}
    owners: dict[tuple[str, Slice], int] = {}
    crcs: dict[str, int] = {}
    differ: dict[str, list[int]] = {}
    for r, g in enumerate(gathered):
        for path, (dtype, gshape, offsets, shape, crc) in g["pieces"].items():
            if crc is not None and crcs.setdefault(path, crc) != crc:
                differ.setdefault(path, []).append(r)
            e = entries.setdefault(path, TensorEntry(dtype, tuple(gshape), []))
            if (e.dtype, e.global_shape) != (dtype, tuple(gshape)):
                raise CheckpointError(
                    f"{path}: rank {r} holds {dtype}{list(gshape)} but a lower rank holds "
                    f"{e.dtype}{list(e.global_shape)}; all ranks must agree on global shapes"
                )
            piece = Slice(tuple(offsets), tuple(shape))
            if piece.numel and (path, piece) not in owners:
                owners[(path, piece)] = r
                e.pieces.append(Piece(f"rank{r:05d}.safetensors", piece))
    for path, e in entries.items():
        check_tiling(path, e.global_shape, [p.slice for p in e.pieces])
    mine = gathered[rank]["pieces"]
    writers = {}
    for path, (_, _, offsets, shape, _) in mine.items():
        piece = Slice(tuple(offsets), tuple(shape))
        if piece.numel:
            writers[path] = owners[(path, piece)]
    return entries, writers, differ
