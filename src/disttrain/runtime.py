"""Process runtime: who am I, how many are we, which device and backend.

`init()` reads the environment that torchrun and `disttrain run` set (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or derives it from Slurm's
`srun` or an MPI `mpiexec` (cluster/launchers.py), and creates the default process
group: gloo on CPU, NCCL with one GPU per local rank on CUDA. With none of it set the
script is a plain `python script.py`: a world of one, backed by an in-memory store, so
every collective still works and the same code runs everywhere.

The state lives in torch.distributed itself; this module keeps none of its own.
"""

from __future__ import annotations

import datetime
import gc
import os

import torch
import torch.distributed as dist

from disttrain import settings
from disttrain.cluster.launchers import env_from_launcher

__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "rank",
    "world_size",
    "local_rank",
    "local_world_size",
    "role",
    "num_servers",
    "device",
    "backend",
    "print0",
    "default_timeout",
]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def default_timeout() -> datetime.timedelta:
    """Collective timeout: `DISTTRAIN_TIMEOUT` seconds, 60 by default (never torch's 30 min)."""
    return datetime.timedelta(seconds=settings.current().timeout)


def _env_int(name: str) -> int:
    raw = os.environ[name]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer") from None


def _pick_backend(requested: str | None) -> str:
    if requested is not None:
        if requested not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {requested!r}")
        if requested == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs CUDA, and torch sees no GPU; use 'gloo'")
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def _limit_cpu_threads(world: int) -> None:
    # NOTE: N processes each using every core slow each other down badly; torchrun sets
    # OMP_NUM_THREADS=1 for the same reason. Respect an explicit user setting.
    if world > 1 and "OMP_NUM_THREADS" not in os.environ:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, per_node)))


def init(
    backend: str | None = None,
    timeout: float | datetime.timedelta | None = None,
    *,
    store: dist.Store | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> None:
    """Create the default process group (blocks until every rank has joined).

    Reads the torchrun environment; with `store`, `rank` and `world_size` given it uses
    those instead (tests use a FileStore). With neither, it makes a world of one.
    Calling it again once initialized does nothing.
    """
    if dist.is_initialized():
        return
    settings.refresh()  # NOTE: a script may set DISTTRAIN_* variables before init()
    if isinstance(timeout, (int, float)):
        timeout = datetime.timedelta(seconds=timeout)
    timeout = timeout or default_timeout()
    name = _pick_backend(backend)
    if store is None:  # `srun python train.py`, `mpiexec -n 4 python train.py`: no torchrun
        os.environ.update(env_from_launcher(os.environ))
    if store is not None:
        if rank is None or world_size is None:
            raise ValueError("init(store=...) also needs rank= and world_size=")
    elif "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
        if missing:
            raise RuntimeError(
                f"partial launcher environment: {', '.join(missing)} not set; "
                "launch with `disttrain run` or `torchrun`, or unset RANK/WORLD_SIZE to run alone"
            )
        rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    else:
        rank, world_size, store = 0, 1, dist.HashStore()
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world of size {world_size}")
    if name == "nccl":
        torch.cuda.set_device(gpu_of(local_rank(), torch.cuda.device_count()))
    _limit_cpu_threads(world_size)
    kwargs = {"backend": name, "timeout": timeout, "rank": rank, "world_size": world_size}
    if store is not None:
        dist.init_process_group(store=store, **kwargs)
    else:
        dist.init_process_group(init_method="env://", **kwargs)
    from disttrain.trace import session  # NOTE: `disttrain run --trace` starts tracing here

    session.on_init(rank, world_size, role())


def gpu_of(local: int, gpus: int) -> int:
    """The GPU of local rank `local` under NCCL, which needs one GPU per rank."""
    if not 0 <= local < gpus:
        raise RuntimeError(
            f"local rank {local} has no GPU of its own: torch sees {gpus} GPU(s) on this node "
            f"and NCCL needs one per rank; start at most {gpus} rank(s) per node "
            f"(`disttrain run --nproc {gpus}`), or hide the GPUs (CUDA_VISIBLE_DEVICES=) to "
            "train every rank on the CPU with gloo")
    return local


def shutdown() -> None:
    """Destroy the default process group if there is one (does not block on peers)."""
    if dist.is_initialized():
        dist.destroy_process_group()
        # NOTE: a reference cycle (autograd hooks, cached work handles) can keep the gloo
        # group alive; freed during interpreter exit, its threads sometimes abort the
        # process ("terminate called without an active exception"). Free it now.
        gc.collect()


def is_initialized() -> bool:
    return dist.is_initialized()


def rank() -> int:
    """Global rank: from the process group once initialized, else from RANK, else 0."""
    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def world_size() -> int:
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def local_rank() -> int:
    """Rank within this machine (LOCAL_RANK), which picks the GPU."""
    return int(os.environ.get("LOCAL_RANK", 0))


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))


def num_servers() -> int:
    """Parameter-server processes in this job (`disttrain run --servers S`), 0 otherwise."""
    return settings.current().servers


def role() -> str:
    """'worker' or 'server'.

    NOTE: in a job started with `--workers W --servers S` the last S global ranks are
    servers and ranks 0..W-1 are workers, so worker ranks are the same numbers a plain
    data-parallel job would use.
    """
    return "server" if rank() >= world_size() - num_servers() else "worker"


def device() -> torch.device:
    """This rank's device: cuda:LOCAL_RANK when CUDA is available, else cpu."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def backend() -> str | None:
    return dist.get_backend() if dist.is_initialized() else None


def print0(*args, **kwargs) -> None:
    """print() on rank 0 only, flushed, so launcher output interleaves sensibly."""
    if rank() == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)
