"""Run a function on N real processes, for tests and notebooks.

`spawn(fn, world_size, *args)` starts `world_size` processes, joins them into one gloo
process group through a FileStore in a temporary folder (no ports, so no port races),
calls `fn(*args)` on each, and returns the per-rank results in rank order. `fn` must be a
module-level function (it is found again by name in the child).

On Linux the ranks come from multiprocessing's "forkserver": one server process, started
at the first call, imports torch and disttrain once (`_PRELOAD`), and each rank is a fork
of it (no fork of the caller, which may hold threads). Elsewhere, or with
`start_method="spawn"`, each rank is a fresh interpreter that imports torch itself. Either
way a rank sees the caller's os.environ as it is at the call, plus `env`; a variable that
a library reads only at import (torch reads few) needs `start_method="spawn"`.

A rank that raises makes `spawn` raise `RankFailedError` carrying that rank's own
traceback; the other ranks are then killed rather than left hanging in a collective.
The whole run is bounded by `timeout` seconds; on expiry the ranks that are still
running are named.

Tensors in results come back as tensors (sent as numpy arrays, so no shared-memory
file descriptors outlive the child).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["spawn", "RankFailedError"]

# NOTE: multiprocessing has one fork server per process, and its preload list counts only
# when the server starts, so every call passes this same list.
_PRELOAD = ["torch", "torch.distributed", "disttrain.runtime", "disttrain.checkpoint",
            "disttrain.comm", "disttrain.data", "disttrain.parallel", "disttrain.ps",
            "disttrain.trace"]


class RankFailedError(RuntimeError):
    """A rank raised; `.rank` is the first failing rank, the message holds its traceback."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank


def _to_plain(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return ("__tensor__", obj.detach().cpu().numpy().copy())
    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_plain(v) for v in obj)
    return obj


def _from_plain(obj: Any) -> Any:
    if isinstance(obj, tuple) and len(obj) == 2 and obj[0] == "__tensor__":
        return torch.from_numpy(obj[1])
    if isinstance(obj, dict):
        return {k: _from_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_from_plain(v) for v in obj)
    return obj


def _child(fn, rank, world_size, store_path, backend, timeout, env, args, results):
    # NOTE: a forked rank starts with the fork server's environment, fixed when the server
    # started; the caller's environment at the call replaces it, as a spawned rank has.
    os.environ.clear()
    os.environ.update(env)
    if "numpy.random" in sys.modules:  # a fork shares the server's seed; a spawned rank has its own
        sys.modules["numpy.random"].seed()
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
         "LOCAL_WORLD_SIZE": str(world_size)}
    )
    torch.set_num_threads(1)
    from torch import distributed as dist

    from disttrain import runtime

    try:
        store = dist.FileStore(store_path, world_size)
        runtime.init(backend, timeout=timeout, store=store, rank=rank, world_size=world_size)
        out = fn(*args)
        results.put((rank, "ok", _to_plain(out)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        runtime.shutdown()


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 90.0,
    backend: str = "gloo",
    collective_timeout: float = 30.0,
    env: dict[str, str] | None = None,
    start_method: str | None = None,
) -> list[Any]:
    """Run `fn(*args)` on `world_size` processes; blocks; returns results by rank.

    `env` is set over the caller's os.environ in every rank. `start_method` is
    "forkserver" (the default on Linux) or "spawn" (the default elsewhere; use it when
    `env` holds a variable that torch or another preloaded module reads at import).
    Raises RankFailedError (with the rank's traceback) if a rank raises, and
    TimeoutError naming the unfinished ranks after `timeout` seconds.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context(start_method)
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="disttrain-spawn-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_child,
                args=(fn, r, world_size, store_path, backend, collective_timeout,
                      {**os.environ, **(env or {})}, args, results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, world_size, timeout)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)


def _context(start_method: str | None):
    methods = mp.get_all_start_methods()
    if start_method is None:
        start_method = ("forkserver" if sys.platform.startswith("linux") and "forkserver" in methods
                        else "spawn")
    if start_method not in ("forkserver", "spawn") or start_method not in methods:
        usable = [m for m in ("forkserver", "spawn") if m in methods]
        raise ValueError(f"start_method must be one of {usable}, got {start_method!r}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _collect(procs, results, world_size, timeout):
    deadline = time.monotonic() + timeout
    out: dict[int, Any] = {}
    while len(out) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(world_size)) - set(out))
            raise TimeoutError(f"spawn: ranks {missing} did not finish within {timeout:.0f}s")
        try:
            rank, status, payload = results.get(timeout=min(remaining, 0.5))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs)
                    if r not in out and not p.is_alive() and p.exitcode not in (0, None)]
            if dead:
                r = dead[0]
                raise RankFailedError(
                    r, f"rank {r} died with exit code {procs[r].exitcode} and no traceback"
                ) from None
            continue
        if status == "error":
            raise RankFailedError(rank, f"rank {rank} failed:\n{payload}")
        out[rank] = _from_plain(payload)
    return [out[r] for r in range(world_size)]
