"""`disttrain.ps.connect`: one call that makes this rank a server or a worker.

One script serves both roles, as ps-lite's single binary does: `disttrain run --workers
W --servers S script.py` makes ranks 0..W-1 workers and the last S ranks servers
(`disttrain.role()`). Every rank builds the same model and calls `connect`; the key plan
(consistent-hash ring, ring.py) follows from the model alone. Servers bind a ZeroMQ
socket, publish its address (`ipc://...` on loopback, else `tcp://host:port`) in the
job's c10d store under `disttrain/ps/<name>/addr<i>`, and serve inside `connect` until
every worker is done; workers read those addresses (blocking until all are there) and
get a `Worker` back.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from disttrain import runtime, settings
from disttrain.ps.compress import TopK, parse_compression
from disttrain.ps.heap import keep_freed_memory
from disttrain.ps.policy import Policy, Sync
from disttrain.ps.ring import DEFAULT_CHUNK_BYTES, plan_keys
from disttrain.ps.server import Server
from disttrain.ps.transport import job_secret
from disttrain.ps.worker import Worker

__all__ = ["connect", "format_stats"]


def connect(model: torch.nn.Module, policy: Policy | None = None,
            optimizer: Callable | None = None, *, timeout: float | None = None,
            host: str | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
            overlap: bool = True, compression: str | TopK | None = None,
            snapshot: str | None = None, snapshot_every: int = 0,
            exit: bool = True, name: str = "ps") -> Worker | dict:
    """Join the parameter-server job as this rank's role. Blocks (see below).

    model: the same architecture on every rank; the servers start from the parameter
        values of the model built on the server rank (seed every rank alike).
    policy: consistency policy (default `Sync()`), used by the servers.
    optimizer: `lambda params: torch.optim.X(params, ...)`, built on each server over its
        shard (default SGD lr=0.1); must be element-wise (SGD, momentum, Adam, AdamW...).
    timeout: seconds of silence after which a worker or server counts as lost
        (default DISTTRAIN_PS_TIMEOUT or 10).
    host: interface servers bind and advertise (default DISTTRAIN_PS_HOST or 127.0.0.1).
    overlap: push each gradient from its hook while backward runs (default); pass False
        when accumulating gradients over several backward passes before one push.
    compression: None (dense pushes) or "topk:ratio=R" / `ps.TopK(R)`: each worker sends,
        per key, only the ceil(R * numel) largest-magnitude gradient entries (indices +
        values) and keeps the rest as a residual added to its next gradient (Deep Gradient
        Compression, Lin et al. 2018; compress.py). Servers accept either kind of push.
    snapshot: path template with `{server}`, e.g. "ckpt/ps{server}.safetensors": a server
        restores from it at start if it exists (printing the version restored and how
        many updates since that snapshot were lost) and saves to it when the job ends.
    snapshot_every: with `snapshot`, also save (atomically) every this many applied
        updates, so a killed server restarted by `disttrain run --max-restarts N` loses
        at most snapshot_every - 1 updates (0: only at the end).
    exit: on a server, exit the process cleanly once served (False: return the stats).

    On a worker: blocks until every server said welcome, returns a `Worker`.
    On a server: serves until all workers are done or lost, then exits (or returns).
    """
    policy = policy if policy is not None else Sync()
    compression = parse_compression(compression)  # NOTE: on every rank, so a typo fails everywhere
    optimizer = optimizer or (lambda params: torch.optim.SGD(params, lr=0.1))
    timeout = timeout if timeout is not None else settings.current().ps_timeout
    servers = runtime.num_servers()
    world = runtime.world_size()
    if servers < 1 or servers >= world:
        raise RuntimeError(
            f"parameter-server job needs 1 <= servers < world size, got DISTTRAIN_SERVERS="
            f"{servers} with world size {world}; launch with "
            "`disttrain run --workers W --servers S script.py`")
    workers = list(range(world - servers))
    plan = plan_keys([(n, p.numel(), p.element_size()) for n, p in model.named_parameters()],
                     servers, chunk_bytes=chunk_bytes)
    store = dist.distributed_c10d._get_default_store()
    secret = job_secret()
    if runtime.role() == "worker":
        addresses = [store.get(f"disttrain/{name}/addr{i}").decode() for i in range(servers)]
        return Worker(model, runtime.rank(), addresses, plan, secret, repr(policy),
                      timeout=timeout, overlap=overlap, compression=compression,
                      chunk_bytes=chunk_bytes)
    index = runtime.rank() - len(workers)
    server = Server(index, plan[index], dict(model.named_parameters()), policy, optimizer,
                    workers, secret, host=host or settings.current().ps_host,
                    timeout=timeout, chunk_bytes=chunk_bytes)
    path = snapshot.format(server=index) if snapshot else None
    if snapshot_every and not path:
        raise ValueError(f"snapshot_every={snapshot_every} needs a snapshot path, e.g. "
                         'connect(..., snapshot="ckpt/ps{server}.safetensors")')
    if path:
        report = server.keep_snapshots(path, snapshot_every)
        if report:
            print(report, flush=True)
    store.set(f"disttrain/{name}/addr{index}", server.address)
    keep_freed_memory()  # NOTE: this process only serves: its receive buffers are reused
    stats = server.serve()
    if path:
        server.snapshot(path)
    if not exit:
        return stats
    print(format_stats(stats), flush=True)
    runtime.shutdown()
    sys.exit(0)


def format_stats(stats: dict) -> str:
    """One line for a server's (or a job's) report, and a second one when its momentum and
    staleness are in the range where training diverges (staleness.divergence_warning)."""
    warning = stats.get("warning")
    return _stats_line(stats) + (f"\n[ps server{stats.get('server', '?')}] WARNING: {warning}"
                                 if warning else "")


def _stats_line(stats: dict) -> str:
    return (f"[ps server{stats.get('server', '?')}] {stats['policy']}: "
            f"{stats.get('keys', '?')} keys, {stats.get('bytes', 0) / 1e6:.2f} MB, "
            f"version {stats['version']}, "
            f"applied {stats['applied']}, dropped late {stats['dropped']}, abandoned partial "
            f"{stats.get('partial_dropped', 0)}, lost workers {stats['lost_workers']}, "
            f"rejected frames {stats.get('rejected_frames', 0)}{_reasons(stats)}, "
            f"staleness {stats['staleness']}"
            + (f", pushes received {stats['push_bytes'] / 1e6:.3f} MB in "
               f"{stats['push_frames']} frames ({stats.get('sparse_pushes', 0)} sparse)"
               if "push_bytes" in stats else "")
            + (f", momentum {stats['momentum']:g} stepped as {stats['applied_momentum']:.3f} "
               "(corrected for asynchrony)" if stats.get("momentum_rule") == "corrected" else "")
            + (f", restored version {stats['restored_version']} (lost updates "
               f"{_or_unknown(stats['lost_updates'])})" if "restored_version" in stats else ""))


def _reasons(stats: dict) -> str:
    """Why frames were rejected, e.g. " (schema:push.clock 2, protocol 1)"; "" if none."""
    counts = stats.get("rejected") or {}
    return f" ({', '.join(f'{k} {n}' for k, n in counts.items())})" if counts else ""


def _or_unknown(n) -> str:
    return "unknown" if n is None else str(n)
