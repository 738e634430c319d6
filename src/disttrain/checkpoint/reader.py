"""Load side of the checkpointer: verify, fall back, reslice, then apply.

For each committed checkpoint, newest first (`latest`, then by step), every rank:

1. stages what it needs without touching the user's objects: reads the manifest, works
   out which slice of each tensor it wants now (a `ShardedTensor` destination says so,
   a plain tensor wants all of it), reads only the files holding overlapping pieces,
   checks each file's size and SHA-256, and assembles its slices (reshard.assemble);
2. tells the others how that went (JSON all-gather). A model mismatch anywhere raises
   CheckpointMismatchError everywhere; a damaged file anywhere makes all ranks skip
   that checkpoint together (rank 0 warns, naming the file) and try the previous one;
3. only when every rank staged a good checkpoint do they apply it.

NOTE: apply order is model, optimizer, loader, then RNG last, so nothing that a load
call might draw from the generators disturbs the restored streams.
"""

from __future__ import annotations

import math
import os
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from disttrain.checkpoint import io, modules, state
from disttrain.checkpoint.manifest import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointWarning,
    CorruptCheckpointError,
    Manifest,
    dtype_from_name,
)
from disttrain.checkpoint.protocols import LoadsShardedState, ShardedState, StageModel
from disttrain.checkpoint.reshard import ShardedTensor, Slice, assemble

__all__ = ["Targets", "load_newest_good"]


@dataclass
class Targets:
    model: Any = None
    optimizer: Any = None
    loader: Any = None
    rng: bool = True


def load_newest_good(directory: str, targets: Targets, group=None, only_step=None):
    """(step, folder, extra) of the checkpoint applied, or None when there is none.

    Blocks: collectives over `group`; every rank must call it.
    """
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    names = io.broadcast_json(io.checkpoint_dirs(directory) if rank == 0 else None, group)
    if only_step is not None:
        wanted = io.step_dir_name(only_step)
        if wanted not in names:
            raise CheckpointError(f"{directory} holds no checkpoint of step {only_step} "
                                  f"(it has {sorted(names) or 'none'})")
        names = [wanted]
    skipped = []
    for i, name in enumerate(names):
        folder = os.path.join(directory, name)
        staged, status = None, {"ok": True}
        try:
            staged = _Staged(folder, targets, rank)
            status["unwanted"] = sorted(staged.unwanted)
        except CorruptCheckpointError as err:
            status = {"corrupt": str(err)}
        except CheckpointMismatchError as err:
            status = {"mismatch": f"rank {rank}: {err}"}
        except Exception:  # noqa: BLE001 - every rank must hear about it, or they hang
            status = {"error": f"rank {rank}: {traceback.format_exc()}"}
        statuses = io.all_gather_json(status, group)
        for kind, exc in (("mismatch", CheckpointMismatchError), ("error", CheckpointError)):
            found = [s[kind] for s in statuses if kind in s]
            if found:
                raise exc(found[0])
        corrupt = list(dict.fromkeys(s["corrupt"] for s in statuses if "corrupt" in s))
        if corrupt:
            then = f"falling back to {names[i + 1]}" if i + 1 < len(names) else "no older one"
            skipped.append(f"{folder}: {'; '.join(corrupt)}")
            if rank == 0:
                warnings.warn(f"checkpoint {folder} is damaged, skipping it ({'; '.join(corrupt)}); "
                              f"{then}", CheckpointWarning, stacklevel=3)
            continue
        _check_all_wanted(folder, statuses)
        staged.apply()
        return staged.manifest.step, folder, staged.extra
    if skipped:
        raise CorruptCheckpointError(
            f"every checkpoint in {directory} is damaged: " + " | ".join(skipped)
            + "; nothing was loaded (delete the folder to start over)")
    return None


MISMATCH_FIX = ("load it into the model (and optimizer) that saved it, or give Checkpointer a new "
                "directory to start over; `disttrain checkpoint inspect DIR` lists what it holds")


def _check_all_wanted(folder: str, statuses: list[dict]) -> None:
    """Saved tensors that no rank's model/optimizer has a place for: another model."""
    unwanted = set.intersection(*(set(s["unwanted"]) for s in statuses))
    if unwanted:
        raise CheckpointMismatchError(
            f"checkpoint {folder} was saved from a different model: unexpected keys (in the "
            f"checkpoint, wanted by no rank): {sorted(unwanted)}; {MISMATCH_FIX}")


def _want(t: torch.Tensor | ShardedTensor) -> Slice:
    if isinstance(t, ShardedTensor):
        return t.slice
    return Slice((0,) * t.dim(), tuple(t.shape))


def _global_shape(t: torch.Tensor | ShardedTensor) -> tuple[int, ...]:
    return t.global_shape if isinstance(t, ShardedTensor) else tuple(t.shape)


class _Staged:
    """Everything one rank will apply from one checkpoint, read and verified."""

    def __init__(self, folder: str, targets: Targets, rank: int):
        self.folder, self.rank, self.targets = folder, rank, targets
        self.manifest = Manifest.read(folder)
        self._files: dict[str, dict[str, torch.Tensor]] = {}
        self.unwanted: set[str] = set()  # saved tensor paths this rank has no place for
        self._actions: list[Callable[[], None]] = []
        for key in ("model", "optimizer"):
            obj = getattr(targets, key)
            if obj is not None:
                self._stage_object(key, obj)
        if targets.loader is not None:
            self._stage_loader(targets.loader)
        if targets.rng:
            self._stage_rng()
        skeleton = self.manifest.trees.get("extra", {})
        self.extra = state.decode(skeleton, lambda p: self.fetch(p, None))

    def apply(self) -> None:
        for action in self._actions:
            action()

    def _file(self, name: str) -> dict[str, torch.Tensor]:
        if name not in self._files:
            self._files[name] = io.read_verified(self.folder, name, self.manifest.files[name])
        return self._files[name]

    def fetch(self, path: str, want: Slice | None) -> torch.Tensor:
        """The `want` slice (None: all) of tensor `path`, from verified files."""
        entry = self.manifest.tensors.get(path)
        if entry is None:
            raise CorruptCheckpointError(f"{self.folder}: manifest has no tensor {path!r}")
        want = want or Slice((0,) * len(entry.global_shape), entry.global_shape)
        pieces = entry.pieces

        def read(i: int) -> torch.Tensor:
            tensors = self._file(pieces[i].file)
            if path not in tensors:
                raise CorruptCheckpointError(f"{self.folder}/{pieces[i].file} lacks {path!r}")
            return tensors[path]

        return assemble(path, want, [p.slice for p in pieces], read, dtype_from_name(entry.dtype))

    def _stage_object(self, key: str, obj: Any) -> None:
        trees = self.manifest.trees
        if key not in trees:
            raise CheckpointMismatchError(
                f"checkpoint {self.folder} holds no {key} state (it has {sorted(trees)}); "
                f"do not pass {key}= to load, or save with {key}=")
        owner = state.state_owner(obj)
        saved = trees[key]
        if key == "optimizer" and (modules.is_by_name(saved) or (modules.is_by_name(
                saved, flat=True) and not isinstance(owner, ShardedState))):
            self._stage_by_name(owner, saved)  # ZeRO's flat state into a plain optimizer too
        elif key == "optimizer" and self._model_needs_by_name(owner):
            converted = modules.by_name_from_positions(saved)
            if converted is None:
                raise CheckpointMismatchError(
                    f"checkpoint {self.folder} holds optimizer state by position without "
                    "parameter names (saved without model=), so it cannot be sliced for "
                    "this tensor/pipeline-parallel model; save with model= and optimizer=")
            self._stage_by_name(owner, *converted)
        elif isinstance(owner, ShardedState) or isinstance(owner, nn.Module):
            self._stage_into_destinations(key, owner, saved)
        else:
            self._stage_whole(key, owner, saved)

    def _stage_into_destinations(self, key: str, owner: Any, saved: Any) -> None:
        """Current state says which keys and slices exist here: fill exactly those."""
        _, dest = state.encode(state.state_of(owner), key)
        mine = state.prune(saved, set(dest))  # without other ranks' keys (pipeline stages)
        self._check_keys(key, set(state.leaves(saved)), dest)
        filled = {p: self.fetch(p, _want(t)) for p, t in dest.items()}
        if isinstance(owner, ShardedState) or isinstance(owner, StageModel):
            def apply() -> None:
                with torch.no_grad():
                    for p, t in dest.items():
                        (t.local if isinstance(t, ShardedTensor) else t).copy_(filled[p])
                if isinstance(owner, LoadsShardedState):
                    owner.load_sharded_state_dict(state.decode(mine, dest.__getitem__))
        else:
            def apply() -> None:
                owner.load_state_dict(state.decode(mine, filled.__getitem__))
        self._actions.append(apply)

    def _model_needs_by_name(self, opt: Any) -> bool:
        model = self.targets.model
        if model is None or not isinstance(opt, torch.optim.Optimizer) or isinstance(opt, ShardedState):
            return False
        owner = state.state_owner(model)
        return isinstance(owner, nn.Module) and modules.needs_by_name(owner)

    def _stage_by_name(self, opt: Any, saved: Any, rename: dict | None = None) -> None:
        """An optimizer saved keyed by parameter name (a TP/PP model's), or by position
        with names (`rename`: by-name path -> saved path): slice each state tensor as
        this rank's parameter is sliced, fill it in place."""
        model = self.targets.model
        if model is None or not isinstance(opt, torch.optim.Optimizer):
            raise CheckpointMismatchError(
                f"checkpoint {self.folder} holds optimizer state keyed by parameter name "
                "(saved from a tensor- or pipeline-parallel model); pass model= too, and a "
                "torch optimizer over that model's parameters, to load it")
        owner = state.state_owner(model)
        modules.materialize(opt)
        try:
            tree = modules.optimizer_state(opt, owner)
        except ValueError as err:
            raise CheckpointMismatchError(f"optimizer: {err}") from None
        # NOTE: parameters the saver had no state for (frozen, never stepped) start empty.
        stateless = [n for n in tree["state"] if n not in saved.get("state", {})]
        for n in stateless:
            del tree["state"][n]
        _, dest = state.encode(tree, "optimizer")
        flat = {p for p, t in dest.items() if self._saved_flat(p, t)}  # ZeRO's (numel,) state
        self._check_keys("optimizer", set(state.leaves(saved)), {
            p: torch.empty(math.prod(_global_shape(t)), device="meta") if p in flat else t
            for p, t in dest.items()})
        filled = {p: self.fetch(p, None).view(_global_shape(t))[_want(t).index()] if p in flat
                  else self.fetch((rename or {}).get(p, p), _want(t)) for p, t in dest.items()}
        mine = state.prune(saved, set(dest))

        def apply() -> None:
            with torch.no_grad():
                for p, t in dest.items():
                    (t.local if isinstance(t, ShardedTensor) else t).copy_(filled[p])
            modules.drop_state(opt, owner, stateless)
            try:
                modules.load_optimizer_state(opt, owner, state.decode(mine, dest.__getitem__))
            except ValueError as err:
                raise CheckpointMismatchError(f"optimizer state does not fit: {err}") from None

        self._actions.append(apply)

    def _saved_flat(self, path: str, t: torch.Tensor | ShardedTensor) -> bool:
        """Whether `path` was saved flattened (ZeRO) for a parameter of several dims."""
        entry, shape = self.manifest.tensors.get(path), _global_shape(t)
        return entry is not None and len(shape) > 1 and list(entry.global_shape) == [
            math.prod(shape)]

    def _stage_whole(self, key: str, owner: Any, saved: Any) -> None:
        """A plain optimizer: its fresh state_dict has no state yet, so load all of it."""
        tree = state.decode(saved, lambda p: self.fetch(p, None))
        if isinstance(tree, dict):
            tree.pop(modules.NAMES_KEY, None)
        groups = getattr(owner, "param_groups", None)
        if groups is not None and isinstance(tree, dict) and "param_groups" in tree:
            have = [len(g["params"]) for g in groups]
            want = [len(g.get("params", [])) for g in tree["param_groups"]]
            if have != want:
                raise CheckpointMismatchError(
                    f"{key}: the checkpoint's parameter groups hold {want} parameters, this "
                    f"optimizer's hold {have}; build the optimizer over the same model")

        def apply() -> None:
            try:
                owner.load_state_dict(tree)
            except (ValueError, KeyError) as err:
                raise CheckpointMismatchError(f"{key} state does not fit: {err}") from None

        self._actions.append(apply)

    def _check_keys(self, key: str, saved: set[str], dest: dict[str, Any]) -> None:
        cut = len(key) + 1
        missing = sorted(p[cut:] for p in set(dest) - saved)
        unexpected = sorted(p[cut:] for p in saved - set(dest))
        wrong = [f"{p[cut:]}: checkpoint {list(self.manifest.tensors[p].global_shape)}, "
                 f"{key} {list(_global_shape(t))}"
                 for p, t in dest.items() if p in saved and p in self.manifest.tensors
                 and self.manifest.tensors[p].global_shape != _global_shape(t)]
        # NOTE: a key saved but not held here may be another rank's (a pipeline stage's
        # layers); only keys that no rank holds are an error (_check_all_wanted).
        self.unwanted |= saved - set(dest)
        if missing or wrong:
            parts = [f"missing keys (in the {key}, not in the checkpoint): {missing}"] * bool(missing)
            parts += [f"unexpected keys (in the checkpoint, not in this rank's {key}): "
                      f"{unexpected}"] * bool(unexpected)
            parts += [f"shape mismatch: {'; '.join(wrong)}"] * bool(wrong)
            raise CheckpointMismatchError(
                f"checkpoint {self.folder} was saved from a different {key}: "
                + "; ".join(parts) + f"; {MISMATCH_FIX}")

    def _stage_loader(self, loader: Any) -> None:
        ranks = self.manifest.ranks
        mine = ranks[self.rank] if self.rank < len(ranks) else ranks[0]
        if "loader" not in mine:
            warnings.warn(f"checkpoint {self.folder} holds no loader position; the loader "
                          "starts from its beginning", CheckpointWarning, stacklevel=4)
            return
        position = state.decode(mine["loader"], lambda p: None)
        self._actions.append(lambda: loader.load_state_dict(position))

    def _stage_rng(self) -> None:
        ranks = self.manifest.ranks
        if self.rank >= len(ranks):
            warnings.warn(f"checkpoint {self.folder} was saved by {len(ranks)} ranks; rank "
                          f"{self.rank} keeps its own RNG state", CheckpointWarning, stacklevel=4)
            return
        tensors = {}
        for name in ("torch", "cuda"):
            entry = self.manifest.tensors.get(f"rng/{name}")
            if entry is not None:
                row = Slice((self.rank, 0), (1, entry.global_shape[1]))
                tensors[name] = self.fetch(f"rng/{name}", row)[0]
        json_state = ranks[self.rank]["rng"]
        self._actions.append(lambda: state.restore_rng(json_state, tensors))
