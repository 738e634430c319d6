"""`Checkpointer`: every rank calls save/load; the library decides who writes what.

More (the design and its reasons): docs/design/checkpoints.md, "Notes from checkpoint/checkpointer.py".
"""

from __future__ import annotations

import os
import shutil
import warnings
import zlib
from typing import Any

import torch
import torch.distributed as dist

from disttrain.checkpoint import io, modules, plan, reader, state
from disttrain.checkpoint.manifest import (
    CheckpointError,
    CheckpointWarning,
    Manifest,
    dtype_name,
)
from disttrain.checkpoint.protocols import ShardedState
from disttrain.checkpoint.reshard import ShardedTensor
from disttrain.trace import events as trace_events

__all__ = ["Checkpointer"]


def _rank_world(group) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return step


class Checkpointer:
    """Save and resume training state in `directory`, keeping the newest `keep` saves.

    directory: a folder every rank can read and write (local disk on one machine, a
        shared filesystem across machines); created if missing.
    keep: how many committed checkpoints to keep (older ones are deleted after a save).
    group: the process group that saves together (None = all ranks).
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 3, group=None):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1 (checkpoints to keep), got {keep!r}")
        self.directory = os.fspath(directory)
        self.keep = keep
        self.group = group
        self.extra: dict[str, Any] = {}
        self.loaded_from: str | None = None

    def steps(self) -> list[int]:
        """Steps of the committed checkpoints, newest (as `load` tries them) first."""
        return [int(n.split("_")[1]) for n in io.checkpoint_dirs(self.directory)]

    @trace_events.traced("checkpoint.save", "checkpoint")
    def save(self, step: int, *, model: Any = None, optimizer: Any = None,
             loader: Any = None, extra: dict[str, Any] | None = None) -> str:
        """Save a checkpoint of `step`; returns its folder. Blocks: a collective.

        model/optimizer: anything with `state_dict()` or `sharded_state_dict()`.
        loader: anything with a JSON-able `state_dict()` (the sampler position).
        extra: a dict of numbers, strings, tensors... (rank 0's copy is saved).
        """
        rank, world = _rank_world(self.group)
        try:
            trees, tensors, payload = _prepare(step, rank, world, model, optimizer, loader, extra)
        except (TypeError, ValueError) as err:
            failure, payload = err, {"error": f"rank {rank}: {err}"}
        else:
            failure = None
        # NOTE: bad input on one rank must not leave the others waiting in a collective:
        # the first exchange carries the error, and every rank raises.
        gathered = io.all_gather_json(payload, self.group)
        errors = [g["error"] for g in gathered if "error" in g]
        if failure is not None:
            raise failure
        if errors:
            raise CheckpointError(f"saving step {step} failed: {'; '.join(errors)}")
        trees.update(plan.merged_trees(gathered))
        entries, writers, differ = plan.plan(gathered, rank)
        if differ and rank == 0:
            warnings.warn(
                f"step {step}: tensors saved as replicated differ between ranks (tensor: "
                f"ranks whose copy differs from the first holder's): "
                f"{dict(sorted(differ.items())[:8])} ({len(differ)} in all); the first "
                "holder's copy is saved. Fine for per-rank buffers "
                "such as BatchNorm statistics; a sharded layer (tensor parallel) must "
                "declare its slice through sharded_state_dict() or its other pieces are lost",
                CheckpointWarning, stacklevel=2)
        final = io.step_dir_name(step)
        tmp = os.path.join(self.directory, f".tmp-{final}-{gathered[0]['nonce']}")
        mine = {p: _local(tensors[p]) for p, r in writers.items() if r == rank}
        report = _write_mine(tmp, rank, mine)
        reports = io.all_gather_json(report, self.group)
        errors = [r["error"] for r in reports if "error" in r]
        outcome = None
        if rank == 0:
            outcome = self._commit(step, tmp, final, entries, reports, trees, gathered, errors)
        outcome = io.broadcast_json(outcome, self.group)
        if errors or outcome != "ok":
            raise CheckpointError(f"saving step {step} failed: " + "; ".join(errors or [outcome]))
        return os.path.join(self.directory, final)

    def _commit(self, step, tmp, final, entries, reports, trees, gathered, errors) -> str:
        """Rank 0: manifest, rename, `latest`, prune; returns 'ok' or the error text."""
        if errors:
            shutil.rmtree(tmp, ignore_errors=True)
            return "failed"
        try:
            files = {r["file"]: r["entry"] for r in reports if r.get("file")}
            manifest = Manifest(step=step, world_size=len(gathered), files=files,
                                tensors=entries, trees=trees,
                                ranks=[g["state"] for g in gathered])
            os.makedirs(tmp, exist_ok=True)
            io.write_durable(os.path.join(tmp, "manifest.json"), manifest.to_json().encode())
            io.fsync_dir(tmp)
            target = os.path.join(self.directory, final)
            if os.path.exists(target):  # re-saving a step: move the old one aside first
                os.rename(target, os.path.join(self.directory, f".replaced-{final}"))
            os.rename(tmp, target)
            io.fsync_dir(self.directory)
            io.write_latest(self.directory, final)
            io.prune(self.directory, self.keep, final)
        except OSError as err:
            return f"rank 0 could not commit {final}: {err}"
        return "ok"

    @trace_events.traced("checkpoint.load", "checkpoint")
    def load(self, *, model: Any = None, optimizer: Any = None, loader: Any = None,
             extra: dict[str, Any] | None = None, rng: bool = True,
             step: int | None = None) -> int:
        """Restore the newest good checkpoint into the given objects; returns its step.

        Returns 0 (and changes nothing) when the folder holds no checkpoint. A
        checkpoint with a missing, truncated or altered file is skipped with a
        CheckpointWarning naming the file, and the previous one is tried; when none is
        good, raises CorruptCheckpointError. A checkpoint of another model raises
        CheckpointMismatchError naming the keys. `extra` (if given) is updated in place
        and `self.extra` holds the saved extra. `rng=False` leaves the RNGs alone.
        `step=N` loads exactly that checkpoint (raising if it is missing or damaged).
        Blocks: a collective over `group`.
        """
        if step is not None:
            _check_step(step)
        targets = reader.Targets(model=model, optimizer=optimizer, loader=loader, rng=rng)
        found = reader.load_newest_good(self.directory, targets, self.group, only_step=step)
        if found is None:
            return 0
        step, folder, loaded_extra = found
        self.loaded_from, self.extra = folder, loaded_extra
        if extra is not None:
            extra.update(loaded_extra)
        return step


def _prepare(step, rank, world, model, optimizer, loader, extra):
    """This rank's (trees, tensors, payload for the first exchange). Does not block
    (unless a `state_dict()` does: ZeRO stage 3 gathers its parameters)."""
    step = _check_step(step)
    trees, tensors = {}, {}
    for key, obj in (("model", model), ("optimizer", optimizer)):
        if obj is not None:
            trees[key], found = state.encode(_state_for(key, obj, model), key)
            tensors.update(found)
    if extra is not None:
        if not isinstance(extra, dict):
            raise TypeError(f"extra must be a dict, got {type(extra).__name__}")
        trees["extra"], found = state.encode(extra, "extra")
        tensors.update(found if rank == 0 else {})
    rng_json, rng = state.capture_rng()
    rank_state = {"rng": rng_json}
    if loader is not None:
        rank_state["loader"] = _json_only(loader.state_dict(), "loader.state_dict()")
    for name, t in rng.items():
        tensors[f"rng/{name}"] = ShardedTensor(t[None], (world, t.numel()), (rank, 0))
    payload = {
        "step": step,
        "pieces": {p: _describe(t) for p, t in tensors.items()},
        "trees": {k: v for k, v in trees.items() if k != "extra"},
        "state": rank_state,
        "nonce": os.urandom(6).hex(),
    }
    return trees, tensors, payload


def _state_for(key: str, obj: Any, model: Any) -> Any:
    """The state saved for `obj`; a plain optimizer of a TP/PP model is keyed by
    parameter name with sliced moments (modules.optimizer_state), so it reshards."""
    if key == "optimizer" and model is not None and _plain_optimizer(obj):
        owner = state.state_owner(model)
        if isinstance(owner, torch.nn.Module):
            if modules.needs_by_name(owner):
                return modules.optimizer_state(obj, owner)
            names = modules.position_names(obj, owner)
            if names is not None:  # lets it load into a TP/PP model later
                return {**state.state_of(obj), modules.NAMES_KEY: names}
    return state.state_of(obj)


def _plain_optimizer(obj: Any) -> bool:
    return isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, ShardedState)


def _json_only(value: Any, what: str) -> Any:
    skeleton, tensors = state.encode(value, what)
    if tensors:
        raise TypeError(f"{what} must be JSON-able (no tensors), found {sorted(tensors)}")
    return skeleton


def _describe(t: torch.Tensor | ShardedTensor) -> list:
    """[dtype, global shape, offsets, shape, CRC-32 of the bytes (pieces: None)]."""
    if isinstance(t, ShardedTensor):
        return [dtype_name(t.local.dtype), list(t.global_shape), list(t.offsets),
                list(t.local.shape), None]
    return [dtype_name(t.dtype), list(t.shape), [0] * t.dim(), list(t.shape), _crc(t)]


def _crc(t: torch.Tensor) -> int:
    """Cheap fingerprint, to notice 'replicated' tensors that differ between ranks."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return zlib.crc32(flat.view(torch.uint8).numpy()) if flat.numel() else 0


def _local(t: torch.Tensor | ShardedTensor) -> torch.Tensor:
    return t.local if isinstance(t, ShardedTensor) else t


def _write_mine(tmp: str, rank: int, mine: dict[str, torch.Tensor]) -> dict[str, Any]:
    if not mine:
        return {}
    name = f"rank{rank:05d}.safetensors"
    try:
        os.makedirs(tmp, exist_ok=True)
        entry = io.write_tensors(os.path.join(tmp, name), mine)
    except (OSError, ValueError, RuntimeError) as err:
        return {"error": f"rank {rank} could not write {name}: {err}"}
    return {"file": name, "entry": entry}
