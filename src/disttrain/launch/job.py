"""`disttrain run`: start a job's ranks with PyTorch's elastic launcher (the torchrun agent).

Who talks to whom: `cli.py` turns flags into a `RunConfig`; `run()` builds a torch
`LaunchConfig` from it and hands it to `elastic_launch`, whose agent starts one
`python -u disttrain/launch/entry.py script.py args` per local rank, watches them, restarts
the group up to `max_restarts` times, and stops every rank when one fails or the
launcher gets SIGINT/SIGTERM. `entry.py` records a failing rank's traceback to its
TORCHELASTIC_ERROR_FILE; `run()` prints it with that rank's prefix (failures.py).
`run()` also creates the report folder (DISTTRAIN_REPORT_DIR) where each rank's flight
recorder and faulthandler write, for failures.py and hang_report.py.

Rendezvous (several nodes: c10d at MASTER_ADDR:MASTER_PORT, rendezvous.py), output
prefixes, hangs and the exit codes: docs/design/launcher.md ("Launcher", "Hangs and bad
input"). Parameter-server jobs (`--workers W --servers S`) start W+S ranks and set
DISTTRAIN_SERVERS=S; the last S global ranks are servers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field

from torch.distributed import DistError
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.launcher.api import elastic_launch

from disttrain import settings
from disttrain.launch.agent_config import launch_config
from disttrain.launch.entry import check_module
from disttrain.launch.failures import node_report, rank_prefix, report_failures
from disttrain.launch.preemption import DEFAULT_GRACE, Preemption
from disttrain.launch.ps_manager import ps_manager
from disttrain.trace.merge import clear as clear_trace
from disttrain.trace.merge import merge_and_tell
from disttrain.trace.recorder import parse_steps

__all__ = ["RunConfig", "run", "rank_prefix"]

ENTRY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "entry.py")
MIN_SECRET_CHARS = 16


@dataclass
class RunConfig:
    """One `disttrain run` invocation; validated on construction, nothing started yet."""

    script: str
    """Path of the Python script every rank runs as `__main__` (with `module`: its name)."""
    script_args: list[str] = field(default_factory=list)
    """Arguments after the script, passed to it unchanged."""
    module: bool = False
    """`script` names a module, run as `python -m script` runs it (torchrun's -m)."""
    nproc: int | None = None
    """Processes per node (data-parallel job); default 1. Excludes workers/servers."""
    workers: int | None = None
    """Parameter-server job: worker processes in the whole job (with `servers`)."""
    servers: int | None = None
    """Parameter-server job: server processes in the whole job (the last global ranks)."""
    nnodes: int = 1
    """Machines in the job; each runs `disttrain run` with its own node_rank."""
    node_rank: int = 0
    """This machine's index, 0..nnodes-1; node 0 hosts the rendezvous store (c10d's node
    order, not this, gives the ranks: see `local_addr`)."""
    master_addr: str | None = None
    """Address of node 0, reachable from every node (needed when nnodes > 1)."""
    master_port: int = 29500
    """Port of the rendezvous store on node 0 (multi-node or with master_addr)."""
    rdzv_id: str = "disttrain"
    """Rendezvous id, the same on every node of a job (several nodes or master_addr)."""
    local_addr: str | None = None
    """This node's address as the others reach it (default: master_addr on node 0, the host
    name elsewhere). c10d sorts the nodes by it and gives the k-th node ranks k*nproc..;
    the first node's is the ranks' MASTER_ADDR."""
    max_restarts: int = 0
    """Times the whole group of ranks is restarted after a failure before giving up."""
    timeout: float | None = None
    """Collective timeout in seconds for the ranks (DISTTRAIN_TIMEOUT); runtime default if None."""
    log_dir: str | None = None
    """Keep every rank's stdout/stderr/error files here; default: a temp folder, removed."""
    trace: str | None = None
    """Trace every rank into this folder (DISTTRAIN_TRACE); merged into trace.json after the job."""
    trace_steps: str | None = None
    """'A:B': trace only steps A..B-1 (DISTTRAIN_TRACE_STEPS)."""
    grace_seconds: float = DEFAULT_GRACE
    """After SIGTERM: seconds the ranks get to save and exit (disttrain.preempted()) before
    they are stopped; 0 stops them at once."""

    def __post_init__(self) -> None:
        self.script_args = list(self.script_args)
        if self.module:
            check_module(self.script)
        elif not os.path.isfile(self.script):
            where = "" if os.path.isabs(self.script) else f" (relative to {os.getcwd()})"
            raise ValueError(f"script {self.script!r} not found{where}; give the path of a .py file")
        ps_mode = self.workers is not None or self.servers is not None
        if ps_mode and self.nproc is not None:
            raise ValueError(
                "--nproc and --workers/--servers are mutually exclusive: use --nproc N for a "
                "data-parallel job or --workers W --servers S for a parameter-server job"
            )
        if ps_mode:
            if self.workers is None or self.servers is None:
                raise ValueError("a parameter-server job needs both --workers W and --servers S")
            if self.workers < 1 or self.servers < 1:
                raise ValueError(
                    f"--workers ({self.workers}) and --servers ({self.servers}) must both be >= 1"
                )
            if (self.workers + self.servers) % self.nnodes:
                raise ValueError(
                    f"workers({self.workers}) + servers({self.servers}) must divide evenly over "
                    f"nnodes({self.nnodes}); every node runs the same number of processes"
                )
        elif self.nproc is not None and self.nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {self.nproc}")
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} must be in 0..{self.nnodes - 1}")
        if self.nnodes > 1 and not self.master_addr:
            raise ValueError(
                f"a {self.nnodes}-node job needs --master-addr: the address of node 0 that "
                "every node can reach (and the same --master-port on every node)"
            )
        if not self.rdzv_id:
            raise ValueError("--rdzv-id must not be empty: give every node of the job the same id")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"--master-port must be in 1..65535, got {self.master_port}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if not 0 <= self.grace_seconds < float("inf"):
            raise ValueError(f"--grace-seconds must be >= 0 (0: stop at once), got {self.grace_seconds}")
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"--timeout must be > 0 seconds, got {self.timeout}")
        if self.trace_steps is not None:
            if self.trace is None:
                raise ValueError("--trace-steps needs --trace DIR")
            parse_steps(self.trace_steps)

    @property
    def nproc_per_node(self) -> int:
        if self.workers is not None:
            return (self.workers + self.servers) // self.nnodes
        return self.nproc or 1

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def rank_env(cfg: RunConfig, environ: dict[str, str]) -> dict[str, str]:
    """Variables the ranks get on top of `environ` (the launcher's own environment).

    NOTE: the secret travels by environment only, never on a command line (visible
    to every user via ps). A user-set DISTTRAIN_SECRET is kept; one node draws a fresh
    one. Multi-node jobs get none unless the user exports the same one on every node
    (required for parameter-server jobs, whose frames it authenticates).
    """
    env = {settings.SERVERS: str(cfg.servers or 0)}
    # NOTE: torch >= 2.5 shares the rendezvous TCPStore with the ranks and keeps it across
    # restarts, so a restarted rank can read a dead peer's gloo address from the previous
    # attempt (pytorch/pytorch#135712: "connectFullMesh ... Connection refused"). The agent
    # reads this in the launcher's own environment; every attempt then gets a fresh store.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = environ.get(
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    secret = settings.Settings.from_env(environ).secret  # NOTE: a bad setting fails here, at launch
    if secret is not None and len(secret) < MIN_SECRET_CHARS:
        raise ValueError(
            f"DISTTRAIN_SECRET has {len(secret)} characters, fewer than {MIN_SECRET_CHARS}; "
            "use e.g. `export DISTTRAIN_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')`"
        )
    if secret is None and cfg.nnodes > 1 and cfg.servers:
        raise ValueError(
            "a multi-node parameter-server job needs the same DISTTRAIN_SECRET on every node: "
            "run `export DISTTRAIN_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')` "
            "once and set that value on every node"
        )
    if secret is None and cfg.nnodes == 1:
        # NOTE: only one node can draw the job's secret; several would draw different ones.
        env[settings.SECRET] = secrets.token_hex(32)
    if cfg.timeout is not None:
        env[settings.TIMEOUT] = repr(float(cfg.timeout))
    if cfg.trace is not None:
        env[settings.TRACE] = os.path.abspath(cfg.trace)
        env[settings.TRACE_STEPS] = cfg.trace_steps or ""
    if cfg.nproc_per_node > 1 and "OMP_NUM_THREADS" not in environ:
        # NOTE: like torchrun, keep N ranks from each starting one thread per core; unlike
        # torchrun's flat 1, share the cores this launcher may use among its ranks.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        env["OMP_NUM_THREADS"] = str(max(1, (cores or 1) // cfg.nproc_per_node))
    return env


def run(cfg: RunConfig) -> int:
    """Run the job to its end (blocks); return the exit code for the launcher process.

    0 when every rank exited 0; otherwise the root-cause rank's exit code (128+signal
    for a rank killed by a signal, 130 when the launcher itself was interrupted, 143
    (EXIT_PREEMPTED) after SIGTERM: preempted, see preemption.py).
    """
    env = rank_env(cfg, dict(os.environ))
    shared = settings.refresh().cluster_reports  # NOTE: the launcher reads its environment now
    log_dir = cfg.log_dir or tempfile.mkdtemp(prefix="disttrain-run-")
    # NOTE: `run --cluster` gives every node one shared folder (launch/cluster_run.py), so a
    # node's hang report sees the flight recorders of the other nodes' ranks too.
    report_dir = shared or os.path.join(log_dir, "reports")
    os.makedirs(report_dir, exist_ok=True)
    preemption = Preemption(report_dir, cfg.grace_seconds)
    scratch = tempfile.mkdtemp(prefix="disttrain-scratch-")  # NOTE: removed in `finally`
    env.update({settings.REPORT_DIR: report_dir, settings.SCRATCH: scratch},
               **preemption.rank_env())
    if cfg.trace is not None and not shared:
        clear_trace(cfg.trace)  # NOTE: under `run --cluster` the driver clears it, once
    if cfg.nnodes > 1:  # the rendezvous may wait long for late nodes: say what for
        print(f"disttrain run: node {cfg.node_rank} of {cfg.nnodes}: meeting the other nodes "
              f"at {cfg.master_addr}:{cfg.master_port} (c10d rendezvous {cfg.rdzv_id!r})",
              file=sys.stderr, flush=True)
    try:
        # NOTE: ps_manager first: it forks before the agent's threads and adds its address to env
        with ps_manager(cfg, log_dir, env), _environ(env), _quiet_elastic_logs(), preemption:
            elastic_launch(launch_config(cfg, log_dir), sys.executable)(
                "-u", ENTRY, *(["-m"] if cfg.module else []), cfg.script, *cfg.script_args
            )
        return preemption.finished()
    except ChildFailedError as err:
        if shared:  # NOTE: `run --cluster`: launch/cluster_run.py prints the nodes' reports, cause first
            return node_report(err.failures, report_dir, cfg.world_size,
                               os.path.join(shared, f"node{cfg.node_rank}.json"))
        return report_failures(err.failures, sys.stderr, report_dir, cfg.world_size)
    except SignalException as sig:
        return preemption.stopped(sig.sigval)
    except KeyboardInterrupt:  # before the agent installed its handlers: no rank started
        print("disttrain run: interrupted before the ranks started", file=sys.stderr)
        return 128 + int(signal.SIGINT)
    except (DistError, RendezvousError) as err:
        where = f"{cfg.master_addr}:{cfg.master_port}" if cfg.master_addr else "localhost"
        print(
            f"disttrain run: error: the nodes could not meet at {where}: {err}\n"
            "Check that --master-addr is node 0's address as every node sees it, that "
            "--master-port is free on node 0 and open between the nodes, and that every node "
            "runs the same --nnodes and --rdzv-id.",
            file=sys.stderr,
        )
        return 1
    except Exception as err:
        # NOTE: a signal that lands inside torch's metrics wrapper before it set its start
        # time surfaces as that wrapper's UnboundLocalError, the SignalException only in
        # the context chain (the agent still stopped every rank in its `finally`).
        sig = _signal_in_chain(err)
        if sig is None:
            raise
        return preemption.stopped(sig.sigval)
    finally:
        if cfg.trace is not None and not shared:
            merge_and_tell(cfg.trace)  # NOTE: under `run --cluster` the driver merges once
        if cfg.log_dir is None:
            shutil.rmtree(log_dir, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)  # ranks' ipc folders, takeover files


def _signal_in_chain(err: BaseException) -> SignalException | None:
    """The SignalException that `err` was raised while handling, if any."""
    seen: set[int] = set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, SignalException):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


@contextlib.contextmanager
def _environ(extra: dict[str, str]):
    """Set `extra` in os.environ (the agent copies it into every rank), then restore."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _quiet_elastic_logs():
    """Hide the agent's routine log lines (run() reports failures itself).

    NOTE: elastic's loggers carry their own levels, so the parent's level would not
    stop them; cutting propagation at the parent does. LOGLEVEL=INFO (torchrun's own
    switch) keeps them.
    """
    if "LOGLEVEL" in os.environ:
        yield
        return
    loggers = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.distributed.launcher")]
    sink = logging.NullHandler()
    saved = [lg.propagate for lg in loggers]
    for lg in loggers:
        lg.propagate = False
        lg.addHandler(sink)
    try:
        yield
    finally:
        for lg, propagate in zip(loggers, saved):
            lg.propagate = propagate
            lg.removeHandler(sink)
