"""Durable files and small JSON collectives for the checkpointer.

Files: every write goes to its final folder's temporary sibling, is fsynced, and becomes
visible by `os.replace`/`os.rename` (atomic on POSIX), so a process killed at any
instant leaves either the old state or the new one, never a torn file under a
committed name. The same holds for the `latest` pointer.

Collectives: ranks agree on metadata by exchanging JSON as uint8 tensors over the
process group (no `all_gather_object`, which pickles). With no process group they
degrade to a world of one, so the checkpointer works in a plain `python script.py`.

Who talks to whom: checkpointer.py -> here -> the filesystem and torch.distributed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist

from disttrain.checkpoint.manifest import MANIFEST, CorruptCheckpointError
from disttrain.comm import ops

__all__ = [
    "LATEST",
    "all_gather_json",
    "broadcast_json",
    "checkpoint_dirs",
    "fsync_dir",
    "read_latest",
    "read_verified",
    "step_dir_name",
    "write_durable",
    "write_latest",
    "write_tensors",
]

LATEST = "latest"
_STEP_RE = re.compile(r"^step_(\d{8,})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def fsync_dir(path: str) -> None:
    """Make a folder's entries (creations, renames) durable. Blocks on the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: str, data: bytes) -> dict[str, Any]:
    """Write `data` to `path` and fsync it; returns {"sha256", "bytes"}. Blocks."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def write_tensors(path: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Save tensors as one safetensors file, durably; returns its checksum entry. Blocks."""
    seen: set[int] = set()
    clean = {}
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        # NOTE: safetensors refuses tensors that share storage (tied weights, views of a
        # flat buffer); copy those so each saved tensor owns exactly its bytes.
        if storage.data_ptr() in seen or storage.nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        clean[name] = t
    return write_durable(path, safetensors.torch.save(clean))


def read_verified(folder: str, name: str, expected: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Read a safetensors file, check size and SHA-256 first; blocks on the read.

    Raises CorruptCheckpointError naming the file when it is missing, truncated or altered.
    """
    path = os.path.join(folder, name)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise CorruptCheckpointError(f"{path} cannot be read ({err.strerror})") from None
    if len(data) != expected["bytes"]:
        raise CorruptCheckpointError(
            f"{path} has {len(data)} bytes, the manifest says {expected['bytes']} (truncated?)"
        )
    digest = hashlib.sha256(data).hexdigest()
    if digest != expected["sha256"]:
        raise CorruptCheckpointError(
            f"{path} fails its SHA-256 check (got {digest[:12]}..., manifest says "
            f"{expected['sha256'][:12]}...): the file was altered or damaged"
        )
    try:
        return safetensors.torch.load(data)
    except Exception as err:  # noqa: BLE001 - any parse failure means a bad file
        raise CorruptCheckpointError(f"{path} is not a valid safetensors file ({err})") from None


def write_latest(directory: str, name: str) -> None:
    """Point `latest` at checkpoint folder `name`, atomically. Blocks on the disk."""
    tmp = os.path.join(directory, f".{LATEST}.tmp")
    write_durable(tmp, (name + "\n").encode())
    os.replace(tmp, os.path.join(directory, LATEST))
    fsync_dir(directory)


def read_latest(directory: str) -> str | None:
    try:
        with open(os.path.join(directory, LATEST), encoding="utf-8") as f:
            name = f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if _STEP_RE.match(name) else None


def checkpoint_dirs(directory: str) -> list[str]:
    """Committed checkpoint folders, most recent first (the order load tries and prune keeps).

    `latest` first, then lower steps, descending; steps above `latest`'s come last: they
    belong to an abandoned run (training restarted from an earlier step in this folder).
    """
    try:
        names = [n for n in os.listdir(directory) if _STEP_RE.match(n)
                 and os.path.isfile(os.path.join(directory, n, MANIFEST))]
    except FileNotFoundError:
        return []

    def step(name: str) -> int:
        return int(_STEP_RE.match(name).group(1))

    latest = read_latest(directory)
    top = step(latest) if latest in names else float("inf")
    names.sort(key=lambda n: (n != latest, step(n) > top, -step(n)))
    return names


def prune(directory: str, keep: int, current: str) -> list[str]:
    """Delete committed checkpoints beyond the newest `keep` and stale temporary folders."""
    removed = []
    for name in checkpoint_dirs(directory)[keep:]:
        if name != current:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
            removed.append(name)
    for name in os.listdir(directory):
        if name.startswith(".tmp-") or name.startswith(".replaced-"):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    return removed


def _group_world(group) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def all_gather_json(obj: Any, group=None) -> list[Any]:
    """Every rank's `obj`, in rank order (blocks: a collective on `group`)."""
    rank, world = _group_world(group)
    if world == 1:
        return [json.loads(json.dumps(obj))]
    # NOTE: NCCL moves only CUDA tensors; gloo only CPU ones (untested here: no GPU).
    dev = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend(group) == "nccl" else torch.device("cpu")
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    ops.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=dev),
                    group=group)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=dev)
    padded[: data.numel()] = data.to(dev)
    outs = [torch.empty(longest, dtype=torch.uint8, device=dev) for _ in range(world)]
    ops.all_gather(outs, padded, group=group)
    return [json.loads(o[: int(s)].cpu().numpy().tobytes().decode())
            for o, s in zip(outs, sizes)]


def broadcast_json(obj: Any, group=None, src_rank: int = 0) -> Any:
    """Group rank `src_rank`'s `obj` on every rank (blocks: a collective)."""
    return all_gather_json(obj if _group_world(group)[0] == src_rank else None, group)[src_rank]
