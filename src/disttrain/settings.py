"""Every `DISTTRAIN_*` environment variable, read once into one typed, frozen `Settings`.

`current()` parses the environment on its first call and keeps the result for the
process, so a hot path (`role()`, the `auto` allreduce's link model) reads a field, never
os.environ. `disttrain.init()` reads it again (a script may set a variable before it,
and `disttrain.testing`'s ranks get theirs then), as does `disttrain run` when it starts
a job; a test that changes os.environ calls `refresh()` itself. A value
that does not parse raises `SettingsError` naming the variable, what it expects and an
example, at the first `current()`, not deep in the job.

Each field carries its variable's name, its parser and who sets it: the user, or
`disttrain run` for the processes it starts (the rank's report folder, its role).
The launcher writes its variables under the same names, the constants below; the
README's settings table lists every one. An empty value counts as unset (as in
CPython's own PYTHON* variables). Modelled on pydantic-settings' typed fields and vLLM's
envs.py, one module that owns every variable.

NOTE: the standard library only: launch/entry.py loads this file by path, because a rank's
entry point imports no disttrain package (it would import torch before the script).
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

__all__ = ["Settings", "SettingsError", "current", "refresh", "variables"]

# The variables, one constant each; readers go through Settings, writers use these.
TIMEOUT = "DISTTRAIN_TIMEOUT"
SECRET = "DISTTRAIN_SECRET"
SERVERS = "DISTTRAIN_SERVERS"
REPORT_DIR = "DISTTRAIN_REPORT_DIR"
PEER_GRACE = "DISTTRAIN_PEER_GRACE"
SUPERVISED = "DISTTRAIN_SUPERVISED"
PREEMPT_SIGNAL = "DISTTRAIN_PREEMPT_SIGNAL"
TRACE = "DISTTRAIN_TRACE"
TRACE_STEPS = "DISTTRAIN_TRACE_STEPS"
PS_TIMEOUT = "DISTTRAIN_PS_TIMEOUT"
PS_WAIT = "DISTTRAIN_PS_WAIT"
PS_HOST = "DISTTRAIN_PS_HOST"
PS_ENCRYPT = "DISTTRAIN_PS_ENCRYPT"
PS_MAC = "DISTTRAIN_PS_MAC"
PS_IPC = "DISTTRAIN_PS_IPC"
PS_SHM = "DISTTRAIN_PS_SHM"
PS_MANAGER = "DISTTRAIN_PS_MANAGER"
PS_TAKEOVER_FILE = "DISTTRAIN_PS_TAKEOVER_FILE"
PS_JOIN = "DISTTRAIN_PS_JOIN"
SCRATCH = "DISTTRAIN_SCRATCH"
LINK_GBPS = "DISTTRAIN_LINK_GBPS"
ALPHA_US = "DISTTRAIN_ALPHA_US"
LOCAL_GBPS = "DISTTRAIN_LOCAL_GBPS"
LOCAL_ALPHA_US = "DISTTRAIN_LOCAL_ALPHA_US"
STEP_US = "DISTTRAIN_STEP_US"
CPU_GBPS = "DISTTRAIN_CPU_GBPS"
CPU_LOCAL_GBPS = "DISTTRAIN_CPU_LOCAL_GBPS"
SHARED_CPU = "DISTTRAIN_SHARED_CPU"
CLUSTER = "DISTTRAIN_CLUSTER"
CLUSTER_NODE = "DISTTRAIN_CLUSTER_NODE"
CLUSTER_CPUS = "DISTTRAIN_CLUSTER_CPUS"
CLUSTER_REPORTS = "DISTTRAIN_CLUSTER_REPORTS"
CLUSTER_DIR = "DISTTRAIN_CLUSTER_DIR"
CLUSTER_NO_CAPS = "DISTTRAIN_CLUSTER_NO_CAPS"

RUN = "disttrain run"
RUN_CLUSTER = "disttrain run --cluster"


class SettingsError(ValueError):
    """A DISTTRAIN_* variable holds a value it cannot have; the message names the fix."""


class Parser(NamedTuple):
    """How one variable's text becomes its value: `convert` raises ValueError when the
    text is not `expected`; `example` is a value that would parse."""

    convert: Callable[[str], Any]
    expected: str
    example: str


def _number(low: float, strict: bool, finite: bool = True) -> Callable[[str], float]:
    def convert(raw: str) -> float:
        value = float(raw)
        if math.isnan(value) or value < low or (strict and value == low) or \
                (finite and math.isinf(value)):
            raise ValueError(raw)
        return value
    return convert


def _whole(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError(raw)
    return value


def _one_of(*choices: str) -> Callable[[str], str]:
    def convert(raw: str) -> str:
        if raw not in choices:
            raise ValueError(raw)
        return raw
    return convert


def _signal_name(raw: str) -> str:
    return signal.Signals[raw].name


SECONDS = Parser(_number(0.0, strict=True), "a number of seconds > 0", "300")
GRACE = Parser(_number(0.0, strict=False), "a number of seconds >= 0", "3")
COUNT = Parser(_whole, "a whole number >= 0", "2")
FLAG = Parser(lambda raw: _one_of("0", "1")(raw) == "1", "0 or 1", "1")
MAC = Parser(lambda raw: _one_of("auto", "always")(raw) == "always", "'auto' or 'always'", "always")
GBPS = Parser(_number(0.0, strict=True, finite=False), "a rate in Gbit/s > 0 (inf: no limit)", "10")
CORES = Parser(_number(0.0, strict=True), "a number of cores > 0", "0.5")
MICROS = Parser(_number(0.0, strict=False), "microseconds >= 0", "50")
SIGNAL = Parser(_signal_name, "a signal name (unset it: disttrain run sets it)", "SIGUSR2")
TEXT = Parser(str, "text", "x")


def _var(name: str, parser: Parser, default: Any, set_by: str = "", *, shown: bool = True) -> Any:
    return field(default=default, repr=shown,
                 metadata={"env": name, "parser": parser, "set_by": set_by})


@dataclass(frozen=True)
class Settings:
    """The DISTTRAIN_* environment of this process, parsed; build it with `from_env`."""

    timeout: float = _var(TIMEOUT, SECONDS, 60.0)
    """Seconds a collective may take before the rank reports a hang and ends (never torch's
    30 min); `disttrain run --timeout S` sets it for the ranks."""
    secret: str | None = _var(SECRET, TEXT, None, shown=False)  # NOTE: never in a log
    """The job's key, in hex (>= 32 digits): authenticates parameter-server frames. `disttrain
    run` draws one on a single node; multi-node parameter-server jobs export one on each."""
    servers: int = _var(SERVERS, COUNT, 0, RUN)
    """Parameter-server processes in the job (`--servers S`): the last S ranks serve."""
    report_dir: str | None = _var(REPORT_DIR, TEXT, None, RUN)
    """Folder for each rank's flight recorder, stack dumps and preemption marker."""
    peer_grace: float = _var(PEER_GRACE, GRACE, 3.0)
    """Seconds a rank whose peer left waits before it exits, so the cause ends first."""
    supervised: bool = _var(SUPERVISED, FLAG, False, RUN)
    """1 in the supervised child that runs a parameter-server worker's script."""
    preempt_signal: str | None = _var(PREEMPT_SIGNAL, SIGNAL, None, RUN)
    """The signal that tells a rank of a preemption notice (default SIGTERM when unset)."""
    trace_dir: str | None = _var(TRACE, TEXT, None, RUN)
    """Trace every rank into this folder from `disttrain.init()` on (`run --trace DIR`)."""
    trace_steps: str | None = _var(TRACE_STEPS, TEXT, None, RUN)
    """'A:B': trace only steps A..B-1 (`run --trace-steps A:B`); checked by trace.start."""
    ps_timeout: float = _var(PS_TIMEOUT, SECONDS, 10.0)
    """Seconds a parameter-server worker or server waits for its peer before it fails."""
    ps_wait: float | None = _var(PS_WAIT, SECONDS, None)
    """Seconds a parameter-server worker waits for a reply a live server (one that answers
    its beats) does not send, before it fails naming it (default 6 x ps_timeout)."""
    ps_host: str = _var(PS_HOST, TEXT, "127.0.0.1")
    """The interface parameter servers bind and advertise (`run --cluster` sets each node's)."""
    ps_encrypt: bool = _var(PS_ENCRYPT, FLAG, False)
    """1: parameter-server tensors are encrypted too (AES-GCM); frames are always signed."""
    ps_mac_always: bool = _var(PS_MAC, MAC, False)
    """'always': sign every byte even between one user's processes on a Unix socket
    (default 'auto': tensor buffers go unsigned there, and through shared memory unless
    DISTTRAIN_PS_SHM=0)."""
    ps_ipc: bool = _var(PS_IPC, FLAG, True)
    """0: parameter servers on loopback use TCP instead of an ipc:// Unix socket."""
    ps_shm: bool = _var(PS_SHM, FLAG, True)
    """0: keep tensors on the socket where they could go through a shared-memory segment
    (a same-user ipc:// connection without DISTTRAIN_PS_MAC=always)."""
    ps_manager: str | None = _var(PS_MANAGER, TEXT, None, RUN)
    """The parameter-server manager's address (`run --servers` starts one and sets it):
    servers register there and workers learn the ring from it; unset: the c10d store."""
    ps_join: int = _var(PS_JOIN, COUNT, 0, "disttrain ps add-server")
    """Set by `disttrain ps add-server` to the job's number of workers: this process is a
    server joining a running job (`ps.connect` calls `ps.join`); 0: not joining."""
    ps_takeover_file: str | None = _var(PS_TAKEOVER_FILE, TEXT, None, RUN)
    """Set by the launcher for a server rank: the server writes there that copies of its
    keys would take over (replicas >= 2 with a manager), so its SIGKILL ends the rank with
    0 and the job goes on (ps/takeover.py)."""
    scratch: str | None = _var(SCRATCH, TEXT, None, RUN)
    """Set by `disttrain run`: a folder it removes when the job ends, however its ranks end
    (SIGTERM, SIGKILL); ranks put their parameter-server ipc folders and takeover files
    there. Unset: the system's temporary folder (each owner removes its own at its end)."""
    link_gbps: float | None = _var(LINK_GBPS, GBPS, None)
    """The cost model's link between nodes, in Gbit/s (model default 10); `run --cluster`
    sets the cluster's link; the trace report compares collectives with it."""
    alpha_us: float | None = _var(ALPHA_US, MICROS, None)
    """The cost model's latency between nodes, in microseconds (model default 100)."""
    local_gbps: float | None = _var(LOCAL_GBPS, GBPS, None)
    """The cost model's link inside a node, in Gbit/s (model default 16)."""
    local_alpha_us: float | None = _var(LOCAL_ALPHA_US, MICROS, None)
    """The cost model's latency inside a node, in microseconds (model default 50)."""
    step_us: float = _var(STEP_US, MICROS, 0.0)
    """The cost model's extra latency per sender in one step, in microseconds."""
    cpu_gbps: float = _var(CPU_GBPS, GBPS, math.inf)
    """The cost model's CPU pool rate for bytes between nodes, in Gbit/s (inf: no limit)."""
    cpu_local_gbps: float = _var(CPU_LOCAL_GBPS, GBPS, math.inf)
    """The cost model's CPU pool rate for bytes inside a node, in Gbit/s (inf: no limit)."""
    shared_cpu: bool = _var(SHARED_CPU, FLAG, False)
    """1: all nodes share one CPU pool in the cost model (`run --cluster` sets 1: one machine)."""
    cluster: str | None = _var(CLUSTER, TEXT, None, RUN_CLUSTER)
    """The emulated cluster's name, for the script."""
    cluster_node: int | None = _var(CLUSTER_NODE, COUNT, None, RUN_CLUSTER)
    """This node's index in the emulated cluster (the trace's node lanes)."""
    cluster_cpus: float | None = _var(CLUSTER_CPUS, CORES, None, RUN_CLUSTER)
    """The emulated node's CPU quota in cores (`cluster up --cpus-per-node`), for the trace."""
    cluster_reports: str | None = _var(CLUSTER_REPORTS, TEXT, None, RUN_CLUSTER)
    """The report folder every node's `disttrain run` shares."""
    cluster_dir: str = _var(CLUSTER_DIR, TEXT, "/run/disttrain/clusters")
    """Where `disttrain cluster` keeps its cluster descriptions."""
    cluster_no_caps: bool = _var(CLUSTER_NO_CAPS, FLAG, False)
    """1: act as if this process lacked CAP_NET_ADMIN and CAP_SYS_ADMIN (for tests)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Parse `environ` (default os.environ); raises SettingsError on a bad value."""
        environ = os.environ if environ is None else environ
        values = {}
        for f in fields(cls):
            raw = environ.get(f.metadata["env"], "")
            if raw != "":
                values[f.name] = parse(f.metadata["env"], raw, f.metadata["parser"])
        return cls(**values)


def parse(name: str, raw: str, parser: Parser) -> Any:
    """`raw`, the text of variable `name`, converted by `parser`; SettingsError otherwise."""
    try:
        return parser.convert(raw)
    except (ValueError, KeyError):
        raise SettingsError(f"{name}={raw!r}: expected {parser.expected}, "
                            f"e.g. {name}={parser.example}") from None


def variables() -> list[tuple[str, str, Any, str]]:
    """(variable, field, default, set by) for every field, in declaration order."""
    return [(f.metadata["env"], f.name, f.default, f.metadata["set_by"]) for f in fields(Settings)]


_current: Settings | None = None


def current() -> Settings:
    """This process's settings: parsed on the first call, then the same object."""
    return _current if _current is not None else refresh()


def refresh(environ: Mapping[str, str] | None = None) -> Settings:
    """Parse the environment again (after os.environ changed) and make that `current()`."""
    global _current
    _current = Settings.from_env(environ)
    return _current
