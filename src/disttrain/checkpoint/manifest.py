"""The checkpoint manifest: one JSON file saying what every other file holds.

A checkpoint is a folder `step_00000100/` with one safetensors file per writing rank and
`manifest.json`: the step, the saving world size, each file's SHA-256 and size, each
tensor's dtype, global shape and the pieces (file, offsets, shape) that hold it, the
JSON skeletons of the model / optimizer / extra trees (checkpoint/state.py) and each
saving rank's RNG and loader state. Like Megatron's dist-checkpointing and
torch.distributed.checkpoint, the pieces are slices of global tensors, so any layout can
read any other (checkpoint/reshard.py). The JSON layout, field by field:
docs/design/checkpoints.md ("Notes from checkpoint/manifest.py").

Pure code plus JSON parsing; every malformed field raises CorruptCheckpointError.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from disttrain.checkpoint.reshard import Slice, check_tiling

__all__ = [
    "FORMAT",
    "MANIFEST",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointWarning",
    "CorruptCheckpointError",
    "Manifest",
    "Piece",
    "TensorEntry",
    "dtype_from_name",
    "dtype_name",
]

FORMAT, VERSION, MANIFEST = "disttrain-checkpoint", 1, "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded."""


class CorruptCheckpointError(CheckpointError):
    """A file of a checkpoint is missing, truncated or fails its SHA-256."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint holds another model/optimizer: names the keys that differ."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (corrupt) or part of the state could not be restored."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"unknown dtype {name!r} in manifest")
    return dtype


@dataclass(frozen=True)
class Piece:
    """One saved slice of a tensor and the file holding it."""

    file: str
    slice: Slice


@dataclass
class TensorEntry:
    dtype: str
    global_shape: tuple[int, ...]
    pieces: list[Piece]

    def layout(self) -> str:
        """Human summary: 'replicated' or e.g. '4 pieces along dim 0'."""
        if len(self.pieces) == 1 and self.pieces[0].slice.shape == self.global_shape:
            return "whole"
        dims = {d for p in self.pieces for d, s in enumerate(p.slice.shape)
                if s != self.global_shape[d]}
        where = f"along dim {dims.pop()}" if len(dims) == 1 else f"along dims {sorted(dims)}"
        return f"{len(self.pieces)} pieces {where}"


@dataclass
class Manifest:
    step: int
    world_size: int
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    trees: dict[str, Any] = field(default_factory=dict)
    ranks: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> str:
        tensors = {
            name: {
                "dtype": e.dtype,
                "global_shape": list(e.global_shape),
                "pieces": [{"file": p.file, "offsets": list(p.slice.offsets),
                            "shape": list(p.slice.shape)} for p in e.pieces],
            }
            for name, e in self.tensors.items()
        }
        doc = {"format": FORMAT, "version": VERSION, "step": self.step,
               "world_size": self.world_size, "torch": torch.__version__,
               "files": self.files, "tensors": tensors, "trees": self.trees,
               "ranks": self.ranks}
        body = _canonical(doc)
        # NOTE: the manifest's own checksum is its last key, over the JSON of the others;
        # json keeps key order, so a reader re-serializes exactly the bytes hashed here.
        return body[:-1] + f',"manifest_sha256":"{_sha(body)}"}}'

    @classmethod
    def read(cls, folder: str) -> Manifest:
        """Parse and validate `folder/manifest.json` (blocks on the file read)."""
        path = os.path.join(folder, MANIFEST)
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{path} is missing") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CorruptCheckpointError(f"{path} is not valid JSON ({err})") from None
        if not isinstance(doc, dict) or doc.pop("manifest_sha256", None) != _sha(_canonical(doc)):
            raise CorruptCheckpointError(f"{path} fails its own SHA-256 check (altered or damaged)")
        try:
            return cls._from_doc(doc)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise CorruptCheckpointError(f"{path} is malformed: {err!r}") from None

    @classmethod
    def _from_doc(cls, doc: dict[str, Any]) -> Manifest:
        if doc.get("format") != FORMAT or doc.get("version") != VERSION:
            raise ValueError(f"not a {FORMAT} v{VERSION} manifest")
        files = {str(k): {"sha256": str(v["sha256"]), "bytes": int(v["bytes"])}
                 for k, v in doc["files"].items()}
        tensors = {}
        for name, e in doc["tensors"].items():
            shape = tuple(int(s) for s in e["global_shape"])
            pieces = [Piece(str(p["file"]), Slice(tuple(int(o) for o in p["offsets"]),
                                                  tuple(int(s) for s in p["shape"])))
                      for p in e["pieces"]]
            for p in pieces:
                if p.file not in files:
                    raise ValueError(f"{name} names file {p.file!r} that is not listed")
            check_tiling(name, shape, [p.slice for p in pieces])
            dtype_from_name(e["dtype"])
            tensors[str(name)] = TensorEntry(str(e["dtype"]), shape, pieces)
        for name in files:
            if os.path.basename(name) != name or name == MANIFEST:
                raise ValueError(f"bad file name {name!r}")
        return cls(step=int(doc["step"]), world_size=int(doc["world_size"]), files=files,
                   tensors=tensors, trees=dict(doc["trees"]), ranks=list(doc["ranks"]))


def _canonical(doc: dict[str, Any]) -> str:
    return json.dumps(doc, separators=(",", ":"), allow_nan=True)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
