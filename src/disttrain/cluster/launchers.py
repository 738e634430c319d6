"""The torchrun environment from other launchers: Slurm's `srun`, Open MPI's and MPICH's `mpiexec`.

`env_from_launcher(os.environ)` returns RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT derived from what the launcher set, so `disttrain.init()`
can make the process group as under torchrun (runtime.init applies it). Pure: reads
the mapping it is given, starts nothing.

- Slurm (inside `srun`: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_STEP_ID): the
  master is the first host of SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST), where task 0
  runs under srun's block distribution; the port is MASTER_PORT or 15000 + job id mod
  20000, so two jobs sharing a node do not collide.
- Open MPI: OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE.
- MPICH / Intel MPI (Hydra): PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS.
MPI does not say where rank 0 runs: MASTER_ADDR defaults to 127.0.0.1 when all ranks
are on one host, and must be exported (`mpiexec -x MASTER_ADDR=...` / `-genv`) otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = ["env_from_launcher", "first_host"]

_MPI = (  # (name, rank, size, local rank, local size)
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MPICH/Hydra", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: 'gpu[03-05,9],cpu1' -> 'gpu03'."""
    m = re.match(r"^([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot read the Slurm node list {nodelist!r}; set MASTER_ADDR yourself")
    prefix, ranges = m.groups()
    return prefix + (ranges.split(",")[0].split("-")[0] if ranges else "")


def _int(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ValueError(f"{name}={environ[name]!r} is not an integer; is the launcher's "
                         "environment intact?") from None


def _slurm(environ: Mapping[str, str]) -> dict[str, str]:
    rank, world = _int(environ, "SLURM_PROCID"), _int(environ, "SLURM_NTASKS")
    local = _int(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else 0
    per_node = environ.get("SLURM_NTASKS_PER_NODE") or environ.get("SLURM_STEP_TASKS_PER_NODE", "")
    local_world = int(re.match(r"\d+", per_node).group()) if re.match(r"\d+", per_node) else world
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or \
        environ.get("SLURM_NODELIST")
    if "MASTER_ADDR" not in environ and not nodelist:
        raise ValueError("srun set SLURM_PROCID but no SLURM_JOB_NODELIST: set MASTER_ADDR to the "
                         "host of task 0")
    port = environ.get("MASTER_PORT") or str(15000 + _int(environ, "SLURM_JOB_ID") % 20000
                                             if "SLURM_JOB_ID" in environ else 29500)
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(local_world),
            "MASTER_ADDR": environ.get("MASTER_ADDR") or first_host(nodelist), "MASTER_PORT": port}


def env_from_launcher(environ: Mapping[str, str]) -> dict[str, str]:
    """torchrun-style variables from Slurm or MPI; {} when torchrun's are set or no launcher is.

    Raises ValueError saying what to export when the launcher's variables do not suffice.
    """
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return {}  # NOTE: torchrun / disttrain run (even inside an allocation) win
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ and "SLURM_STEP_ID" in environ:
        return _slurm(environ)
    for name, rank, size, lrank, lsize in _MPI:
        if rank in environ and size in environ:
            world = _int(environ, size)
            local_world = _int(environ, lsize) if lsize in environ else 1
            addr = environ.get("MASTER_ADDR")
            if addr is None and local_world != world:
                raise ValueError(
                    f"{name} started {world} ranks on several hosts but says nothing about where "
                    "rank 0 runs: export MASTER_ADDR=<rank 0's host> to every rank "
                    "(Open MPI: mpiexec -x MASTER_ADDR=host0; MPICH: mpiexec -genv MASTER_ADDR host0)")
            return {"RANK": str(_int(environ, rank)), "WORLD_SIZE": str(world),
                    "LOCAL_RANK": str(_int(environ, lrank) if lrank in environ else 0),
                    "LOCAL_WORLD_SIZE": str(local_world), "MASTER_ADDR": addr or "127.0.0.1",
                    "MASTER_PORT": environ.get("MASTER_PORT", "29500")}
    return {}
