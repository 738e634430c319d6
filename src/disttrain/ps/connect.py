"""The entry points of a parameter-server job: `serve`, `attach`, and `connect`.

`disttrain run --workers W --servers S script.py` makes ranks 0..W-1 workers and the last
S ranks servers (`disttrain.role()`). Every rank builds the same model; the key plan
(consistent-hash ring, ring.py) follows from the model alone. Each role has its own entry
point that returns one type, as ps-lite's `KVServer` and `KVWorker` are two objects:

- `serve(model, policy, optimizer=...) -> dict` on a server rank: binds a ZeroMQ socket,
  registers its address (`ipc://...` on loopback, else `tcp://host:port`) and keys with
  the job's server manager (manager.py; `disttrain run --servers` starts one) and sends
  it heartbeats (without a manager: publishes the address in the job's c10d store under
  `disttrain/<name>/addr<i>`), serves until every worker is done or lost and returns
  the server's stats. The process goes on: the caller decides.
- `attach(model, policy, ...) -> Worker` on a worker rank: learns those addresses from
  the manager's ring (without a manager: from the store), blocking until all are there,
  and returns a connected `Worker`.
- `connect(model, policy, optimizer, **options)`: the one-script helper (ps-lite's one
  binary, MXNet's kvstore server): on a worker it is `attach`; on a server it is `serve`,
  then it prints the report and ends the server's process with `SystemExit(0)`, so a
  script written for workers needs no role branch. It passes every keyword on: each
  role gets the keywords its entry point takes (every rank passes the same ones).
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from disttrain import runtime, settings
from disttrain.ps.chain import check_replicas
from disttrain.ps.compress import TopK, parse_compression
from disttrain.ps.handover import Handover
from disttrain.ps.heap import keep_freed_memory
from disttrain.ps.join_moves import Joins
from disttrain.ps.join_tails import TailJoins
from disttrain.ps.joiner import join, joining
from disttrain.ps.manager_link import (
    ManagerError,
    fingerprint,
    lookup_addresses,
    register_server,
)
from disttrain.ps.move import Moves
from disttrain.ps.placement import Plan, plan_keys
from disttrain.ps.policy import Policy, Sync
from disttrain.ps.replica import Replicas
from disttrain.ps.report import format_stats
from disttrain.ps.ring import DEFAULT_CHUNK_BYTES
from disttrain.ps.server import Server
from disttrain.ps.takeover import Takeover
from disttrain.ps.transport import job_secret
from disttrain.ps.worker import Worker

__all__ = ["serve", "attach", "connect", "format_stats"]


def _check_job(call: str) -> int:
    """The number of servers, after checking that this is a parameter-server job."""
    servers, world = runtime.num_servers(), runtime.world_size()
    if servers < 1 or servers >= world:
        raise RuntimeError(
            f"ps.{call}: a parameter-server job needs 1 <= servers < world size, got "
            f"DISTTRAIN_SERVERS={servers} with world size {world}; launch with "
            "`disttrain run --workers W --servers S script.py`")
    return servers


def _job(model: torch.nn.Module, call: str, role: str, chunk_bytes: int):
    """This rank's place in the job: (worker ranks, key plan), after checking that the job
    is a parameter-server job and that this rank has the role `call` serves."""
    servers, world = _check_job(call), runtime.world_size()
    if runtime.role() != role:
        other = "attach" if role == "server" else "serve"
        raise RuntimeError(
            f"ps.{call} on rank {runtime.rank()}, which is a {runtime.role()} "
            f"(disttrain.role(): the last {servers} of {world} ranks serve): call "
            f"ps.{other}(...) on this rank, or ps.connect(...), which picks the entry point "
            "by role")
    plan = plan_keys([(n, p.numel(), p.element_size()) for n, p in model.named_parameters()],
                     servers, chunk_bytes=chunk_bytes)
    return list(range(world - servers)), plan


def serve(model: torch.nn.Module, policy: Policy | None = None,
          optimizer: Callable | None = None, *, timeout: float | None = None,
          host: str | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
          snapshot: str | None = None, snapshot_every: int = 0, name: str = "ps",
          manager: str | None = None, replicas: int = 1) -> dict:
    """Serve this server rank's shard until every worker is done or lost; return its stats.

    Blocks for the whole job. Call it on server ranks only (`disttrain.role() == "server"`;
    elsewhere: RuntimeError naming `attach`). Prints nothing but a snapshot restore report;
    `format_stats(stats)` is the report line. Sets the process's allocator to keep freed
    receive buffers (heap.py).

    model: the same architecture on every rank; the servers start from the parameter
        values of the model built here (seed every rank alike).
    policy: consistency policy (default `Sync()`); the workers must pass the same.
    optimizer: `lambda params: torch.optim.X(params, ...)`, built over this server's
        shard (default SGD lr=0.1); must be element-wise (SGD, momentum, Adam, AdamW...).
    timeout: seconds of silence after which a worker counts as lost
        (default DISTTRAIN_PS_TIMEOUT or 10).
    host: interface to bind and advertise (default DISTTRAIN_PS_HOST or 127.0.0.1).
    chunk_bytes: largest key (ring.py) and stream chunk; the same on every rank.
    snapshot: path template with `{server}`, e.g. "ckpt/ps{server}.safetensors": restored
        at start if it exists (printing the version restored and how many updates since
        that snapshot were lost) and saved when the job ends.
    snapshot_every: with `snapshot`, also save (atomically) every this many applied
        updates, so a killed server restarted by `disttrain run --max-restarts N` loses
        at most snapshot_every - 1 updates (0: only at the end).
    name: the job's name in the store (several PS jobs in one process group differ here).
    manager: the server manager's address (manager.py): register there and send it
        heartbeats. Default: DISTTRAIN_PS_MANAGER (`disttrain run --servers` sets it) for
        the group named "ps", none for other names; "" for none. Without one, the
        address goes to the store, where workers read it.
    replicas: copies of each key range (default 1: none). With r > 1 each key also lives
        on the next r-1 servers of the ring, updates are chain-replicated to them, and
        a push is acknowledged (a pull answered) once every copy has it (replica.py);
        the same on every rank, at most the number of servers, not with `snapshot`.
    """
    workers, plan = _job(model, "serve", "server", chunk_bytes)
    policy = policy if policy is not None else Sync()
    check_replicas(replicas, len(plan), snapshot)
    optimizer = optimizer or (lambda params: torch.optim.SGD(params, lr=0.1))
    timeout = timeout if timeout is not None else settings.current().ps_timeout
    index = runtime.rank() - len(workers)
    path = snapshot.format(server=index) if snapshot else None
    if snapshot_every and not path:
        raise ValueError(f"snapshot_every={snapshot_every} needs a snapshot path, e.g. "
                         'serve(..., snapshot="ckpt/ps{server}.safetensors")')
    server = Server(index, plan[index], dict(model.named_parameters()), policy, optimizer,
                    workers, job_secret(),
                    host=host or settings.current().ps_host,
                    timeout=timeout, chunk_bytes=chunk_bytes)
    if path:
        report = server.keep_snapshots(path, snapshot_every)
        if report:
            print(report, flush=True)
    beat, group = None, _manager(manager, name)
    if group:
        try:
            beat = register_server(
                group, index, len(plan), server.address,
                _fingerprint(model, policy, chunk_bytes), _shard(model, plan, index, replicas),
                timeout=timeout, attempt=_attempt(),
                read=lambda: (server.policy.version, server.ep.recv_frames.get("push", 0)))
        except ManagerError:
            server.close()
            raise
    else:
        dist.distributed_c10d._get_default_store().set(f"disttrain/{name}/addr{index}",
                                                       server.address)
    take = _replicate(server, model, plan, replicas, optimizer, policy, beat, host,
                      _addresses(group, name, len(plan)) if replicas > 1 else [],
                      len(workers), chunk_bytes) if replicas > 1 else _moves(
        server, beat, model, plan, policy, optimizer, host, chunk_bytes)
    keep_freed_memory()  # NOTE: before the first receive, so every buffer is kept for reuse
    try:
        stats = server.serve()
        if take is not None:
            stats["takeovers"] = take.finish(3 * timeout)
    finally:
        if beat is not None:
            beat.stop()
    if path:
        server.snapshot(path)
    sizes = {n: p.element_size() for n, p in model.named_parameters()}
    shard_bytes = [sum(c.numel * sizes[c.name] for c in keys) for keys in plan]
    stats.update(mean_bytes=sum(shard_bytes) / len(plan), servers=len(plan))
    return stats


def attach(model: torch.nn.Module, policy: Policy | None = None, *,
           timeout: float | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
           overlap: bool = True, compression: str | TopK | None = None,
           name: str = "ps", manager: str | None = None, replicas: int = 1) -> Worker:
    """Connect this worker rank to every server; return its `Worker`.

    Blocks until every server has published its address and said welcome. Call it on
    worker ranks only (elsewhere: RuntimeError naming `serve`).

    model: the model this worker trains; its parameters receive every pull.
    policy: the servers' consistency policy (default `Sync()`); a server refuses a worker
        whose policy differs, naming both.
    timeout: seconds of silence after which a server counts as lost (default
        DISTTRAIN_PS_TIMEOUT or 10).
    chunk_bytes: largest key and stream chunk; the same on every rank.
    overlap: push each gradient from its hook while backward runs (default); pass False
        when accumulating gradients over several backward passes before one push.
    compression: None (dense pushes) or "topk:ratio=R" / `ps.TopK(R)`: per key, only the
        ceil(R * numel) largest-magnitude gradient entries (indices + values) are sent and
        the rest kept as a residual added to the next gradient (Deep Gradient
        Compression, Lin et al. 2018; compress.py). Servers accept either kind of push.
    name: the job's name in the store, as given to `serve`.
    manager: the server manager's address, as given to `serve`: the servers' addresses
        come from its ring (waiting until every server registered) instead of the store.
    replicas: as given to `serve` (a server refuses a worker whose value differs). With
        r > 1 a push's `wait()` returns once its update is on every copy: under Sync and
        KSync when its round is applied (replica.py); under a policy whose rounds hold
        pushes of workers free to push again (Policy.runs_ahead) on receipt, `held`.
    """
    compression = parse_compression(compression)
    workers, plan = _job(model, "attach", "worker", chunk_bytes)
    policy = policy if policy is not None else Sync()
    check_replicas(replicas, len(plan))
    timeout = timeout if timeout is not None else settings.current().ps_timeout
    group = _manager(manager, name)
    addresses = _addresses(group, name, len(plan))
    return Worker(model, runtime.rank(), addresses, plan, job_secret(), repr(policy),
                  timeout=timeout, overlap=overlap, compression=compression,
                  chunk_bytes=chunk_bytes, replicas=replicas, manager=group,
                  held_acks=replicas > 1 and policy.runs_ahead(),
                  wait=settings.current().ps_wait)


def _replicate(server: Server, model, plan: Plan, replicas: int, optimizer, policy: Policy,
               beat, host: str | None, addresses: list[str], workers: int,
               chunk_bytes: int) -> TailJoins | None:
    """Give `server` its copies and links to the next servers of its chains (replica.py)
    and, with a manager (whose ring says who is dead or drained), its takeover and
    hand-over watch (takeover.py, handover.py) and a join's tail copies (join_tails.py)."""
    init = dict(model.named_parameters())
    server.chain = Replicas(server.index, workers, plan, replicas, init, optimizer, policy,
                            server.ep, job_secret(), timeout=server.timeout,
                            chunk_bytes=chunk_bytes)
    server.chain.connect({j: a for j, a in enumerate(addresses) if j != server.index})
    if beat is None:
        return None
    _tell_supervisor(replicas)
    spec = [(n, p.numel(), p.element_size()) for n, p in model.named_parameters()]
    take = Handover(Takeover(server, beat, plan, init, policy, optimizer, job_secret(),
                             host=host or settings.current().ps_host, chunk_bytes=chunk_bytes))
    return TailJoins(take, server, beat, spec, plan, init, optimizer, job_secret(),
                     chunk_bytes=chunk_bytes)  # NOTE: a join's copies at the tails


def _moves(server: Server, beat, model, plan: Plan, policy: Policy, optimizer,
           host: str | None, chunk_bytes: int) -> Joins | None:
    """With a manager and replicas=1: the watch that moves keys when a server is drained
    (move.py) or joins (join_moves.py)."""
    if beat is None:
        return None
    spec, init = ([(n, p.numel(), p.element_size()) for n, p in model.named_parameters()],
                  dict(model.named_parameters()))
    host = host or settings.current().ps_host
    moves = Moves(server, beat, spec, plan, init, policy, optimizer, job_secret(), host=host,
                  chunk_bytes=chunk_bytes)
    return Joins(moves, server, beat, spec, plan, init, policy, optimizer, job_secret(),
                 host=host, chunk_bytes=chunk_bytes)  # NOTE: a join's moves too (join_moves.py)


def _tell_supervisor(replicas: int) -> None:
    """Tell `disttrain run`'s supervisor of this server rank that a SIGKILL of it is taken
    over by its copies (launch/entry.py): the rank then ends with 0 and the job goes on."""
    path = settings.current().ps_takeover_file
    if path:
        with open(path, "w") as f:
            f.write(f"replicas={replicas}\n")


def _manager(manager: str | None, name: str) -> str | None:
    """The manager address to use: the given one, else the launcher's for group "ps"."""
    if manager is not None:
        return manager or None
    return settings.current().ps_manager if name == "ps" else None


def _addresses(group: str | None, name: str, servers: int) -> list[str]:
    """Every server's address: from the manager's ring (waiting until every server of this
    launch attempt registered) or, without a manager, from the job's store."""
    if group:
        return lookup_addresses(group, runtime.rank(), servers, _SERVERS_WAIT, _attempt())[1]
    store = dist.distributed_c10d._get_default_store()
    return [store.get(f"disttrain/{name}/addr{i}").decode() for i in range(servers)]


def _attempt() -> int:
    """The launch attempt (0, then 1.. after `disttrain run --max-restarts` restarted the
    ranks): a worker uses only servers registered in its own attempt."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def _fingerprint(model: torch.nn.Module, policy: Policy, chunk_bytes: int) -> str:
    return fingerprint([(n, p.numel(), p.element_size()) for n, p in model.named_parameters()],
                       repr(policy), chunk_bytes)


def _shard(model: torch.nn.Module, plan: Plan, index: int,
           replicas: int) -> list[tuple[str, int, list[int]]]:
    """(key, bytes, replica chain) of each key server `index` holds."""
    sizes = {n: p.element_size() for n, p in model.named_parameters()}
    return [(c.key, c.numel * sizes[c.name],
             plan.indices(c.key, replicas))
            for c in plan[index]]


_SERVERS_WAIT = 300.0  # seconds a worker waits for every server to register with the manager
_SERVE = frozenset(inspect.signature(serve).parameters) - {"model"}
_ATTACH = frozenset(inspect.signature(attach).parameters) - {"model"}


def connect(model: torch.nn.Module, policy: Policy | None = None,
            optimizer: Callable | None = None, *, exit: bool = True, **options) -> Worker:
    """One script for both roles: `attach` on a worker, `serve` and end the process on a server.

    On a worker: blocks until every server said welcome, returns the `Worker`.
    In a process `disttrain ps add-server` started (`ps.joining()`): `ps.join` (no
    process group), then the report and SystemExit(0), as on a server.
    On a server: serves until all workers are done or lost, prints the report
    (`format_stats`) and raises `SystemExit(0)` after shutting the process group down, so
    the workers' training loop after this call never runs there (finally blocks and
    atexit handlers still do). To keep the server process, call `serve` on server ranks
    and `attach` on workers instead.

    options: every keyword of `serve` and of `attach` (timeout, host, chunk_bytes, overlap,
        compression, snapshot, snapshot_every, name, ...); each role gets the ones its entry
        point takes, so every rank passes the same ones. A keyword neither takes is a
        TypeError on every rank.
    exit: deprecated; `exit=False` made a server return its stats: call `serve` instead.
    """
    unknown = sorted(set(options) - _SERVE - _ATTACH)
    if unknown:
        raise TypeError(f"ps.connect got unknown keyword(s) {unknown}: it takes those of "
                        f"ps.serve {sorted(_SERVE)} and ps.attach {sorted(_ATTACH)}")
    if not exit:
        warnings.warn("ps.connect(exit=False) is deprecated: call ps.serve(...) on server "
                      "ranks (it returns the stats) and ps.attach(...) on worker ranks",
                      DeprecationWarning, stacklevel=2)
    # NOTE: checked on every rank, so a typo fails on the servers too, not only the workers
    parse_compression(options.get("compression"))
    if joining():  # NOTE: `disttrain ps add-server`: a server with no process group
        stats = join(model, policy, optimizer, workers=joining(), **{
            k: v for k, v in options.items() if k in ("timeout", "host", "chunk_bytes", "snapshot")})
        print(format_stats(stats), flush=True)
        raise SystemExit(0)
    _check_job("connect")
    if runtime.role() == "worker":
        return attach(model, policy, **{k: v for k, v in options.items() if k in _ATTACH})
    stats = serve(model, policy, optimizer, **{k: v for k, v in options.items() if k in _SERVE})
    if not exit:
        return stats
    print(format_stats(stats), flush=True)
    runtime.shutdown()
    raise SystemExit(0)
