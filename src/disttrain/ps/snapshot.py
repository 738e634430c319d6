"""Parameter-server shard snapshots bound to their job, and the count of lost updates.

A server (server.py) saves its shard as one safetensors file whose metadata carries what
the restart needs, written atomically with the tensors: format, server index, version,
applied-gradient count and the job id. Next to it a side file `<snapshot>.version` holds
one fixed-width line, `disttrain-ps job=<job id> version=<v>`, rewritten in place after
every update (no fsync: a SIGKILL keeps the page cache), so a restarted server can say
how many updates its snapshot lacks.

The job id is HMAC-SHA256(DISTTRAIN_SECRET, "disttrain ps job id") cut to 16 hex digits:
the same across `disttrain run --max-restarts` attempts, different for any other job. A
side file of another job is ignored and the report says so; a snapshot of another job
is still restored and the report names its job (docs/design/parameter-server.md,
"Snapshots and server restarts").
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

__all__ = ["job_id", "SideFile", "read_side", "save_atomic", "load", "restart_report",
           "shard_tensors", "load_shard"]

FORMAT = "disttrain-ps-1"
_SIDE = re.compile(rb"disttrain-ps job=([0-9a-f]{16}) version= *(\d{1,20})\n?")


def job_id(secret: bytes) -> str:
    """16 hex digits naming the job of `secret` (one-way: the secret is not recoverable)."""
    return hmac.new(secret, b"disttrain ps job id", hashlib.sha256).hexdigest()[:16]


def read_side(path: str) -> tuple[str | None, int] | None:
    """(job id, version) from a side file; (None, -1) if it is in no known format, None
    if it does not exist."""
    try:
        with open(path, "rb") as f:
            raw = f.read(128)
    except FileNotFoundError:
        return None
    except OSError:
        return (None, -1)
    m = _SIDE.fullmatch(raw)
    return (m.group(1).decode(), int(m.group(2))) if m else (None, -1)


class SideFile:
    """This job's side file, opened (truncated) and stamped with `version` at once."""

    def __init__(self, path: str, job: str, version: int):
        self.job = job
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.write(version)

    def write(self, version: int) -> None:
        """Record `version` in place (fixed width: never a stale tail); does not fsync."""
        os.pwrite(self.fd, b"disttrain-ps job=%s version=%20d\n" % (self.job.encode(), version), 0)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def save_atomic(path: str, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    """Write `tensors` + metadata to `path` atomically; blocks until on disk.

    Written to a temporary file in the same folder, fsynced, then renamed over `path`, so
    a process killed mid-write leaves the previous snapshot intact.
    """
    tmp = f"{path}.tmp{os.getpid()}"
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp,
              metadata=dict(meta, format=FORMAT))
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)  # NOTE: rename after fsync, so `path` is always a whole file
    dirfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dirfd)
    finally:
        os.close(dirfd)


def load(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a snapshot; metadata is {} for files without any."""
    with safe_open(path, "pt") as f:
        meta = dict(f.metadata() or {})
    return load_file(path), meta


def restart_report(path: str, job: str, side: tuple[str | None, int] | None,
                   restored: dict[str, str] | None) -> tuple[str | None, int | None]:
    """(one-line report, lost updates or None when unknown) for a server starting at `path`.

    side: read_side(path + ".version"); restored: the metadata of the snapshot just
    restored (None when there was no snapshot). Lost updates are counted only from a
    side file of this job whose version is not behind the snapshot's.
    """
    side_note, reached = None, None
    if side is not None and side[0] != job:
        who = (f"written by another job (job id {side[0]}; this job is {job})" if side[0]
               else "not in disttrain's side-file format")
        side_note = f"ignoring {path}.version: {who}"
    elif side is not None:
        reached = side[1]
    if restored is None:
        if side is None:
            return None, None
        if reached is None:
            return f"found no snapshot at {path}; {side_note}; starting from version 0", None
        return (f"found no snapshot at {path}; starting again from version 0: all {reached} "
                f"updates were lost (the server had reached version {reached})", reached)
    version = int(restored.get("version", 0))
    report = f"restored version {version} from {path}; "
    saver = restored.get("job")
    origin = ("" if saver == job else
              f" (the snapshot was saved by another job, job id {saver or 'unknown'}: "
              "resuming from it; delete it to start afresh)")
    if side is None:
        return report + "the server's last version is unknown (no .version file)" + origin, None
    if reached is None:
        return report + f"lost updates not counted, {side_note}" + origin, None
    if reached < version:
        return (report + f"lost updates not counted: {path}.version says version {reached}, "
                "behind the snapshot" + origin, None)
    return (report + f"{reached - version} updates since that snapshot were lost (the server "
            f"had reached version {reached})" + origin, reached - version)


def shard_tensors(params: dict, optimizer) -> dict[str, torch.Tensor]:
    """A shard's tensors as a snapshot names them: "param/<key>", "state/<name>/<key>".

    Copies: a server's keys and their state are views of one buffer, and a scalar state
    (Adam's step) is one tensor for many keys (ps/runs.py), which safetensors refuses."""
    tensors = {f"param/{k}": p.detach().clone() for k, p in params.items()}
    if optimizer is not None:
        for k, p in params.items():
            for name, v in optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    tensors[f"state/{name}/{k}"] = v.detach().clone()
    return tensors


def load_shard(path: str, params: dict, optimizer) -> dict[str, str]:
    """Copy the snapshot at `path` into `params` and the optimizer's state; returns its
    metadata. Raises ValueError naming the keys it lacks."""
    loaded, meta = load(path)
    missing = [k for k in params if f"param/{k}" not in loaded]
    if missing:
        raise ValueError(f"snapshot {path} lacks keys {missing[:5]}: it was saved for "
                         "another model or server count")
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(loaded[f"param/{k}"])
            for name in ("exp_avg", "exp_avg_sq", "momentum_buffer", "step"):
                if f"state/{name}/{k}" in loaded and optimizer is not None:
                    optimizer.state[p][name] = loaded[f"state/{name}/{k}"].clone()
    return meta
