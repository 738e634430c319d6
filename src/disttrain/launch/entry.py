"""Run one rank of `disttrain run`: the user's script as `__main__`, its failure recorded.

The elastic agent (job.py) starts every rank as `python -u <this file> script.py args`
(or `-m module args`); this runs the script exactly as `python script.py args` (or
`python -m module args`) would and, when it fails, writes
the exception (user frames, a failure kind: exception, exit, peer-lost, timeout) to
TORCHELASTIC_ERROR_FILE for the launcher (failures.py). A `peer-lost` rank waits up to
DISTTRAIN_PEER_GRACE s so the rank that left ends first; faulthandler dumps every
thread's stack into DISTTRAIN_REPORT_DIR on SIGTERM or a crash; a parameter-server
worker runs in a supervised child so a SIGKILLed worker does not stop the job
(docs/design/launcher.md says why, for each).

NOTE: it is started by path, not with `-m`, so it imports nothing but the standard
library: a rank pays for torch only if the script imports it, and no module of the
disttrain package can shadow a module of the user's script directory. Its DISTTRAIN_*
variables come from disttrain/settings.py (standard library only), loaded by path.
"""

from __future__ import annotations

import faulthandler
import importlib.machinery
import importlib.util
import json
import os
import re
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback

USAGE = "usage: python entry.py script.py|-m module [args...]  (started by `disttrain run`)"
# What gloo/NCCL say, through torch.distributed called directly, when a collective
# failed because of another rank (disttrain.comm's CollectiveError says it by attribute).
_PEER_LOST = re.compile(r"Connection (closed|reset) by peer|Broken pipe|NCCL communicator was aborted")
_TIMED_OUT = re.compile(r"Timed out waiting \d+ms|Watchdog caught collective operation timeout")


def _load_settings():
    """disttrain/settings.py as a module of its own (not the package: see the docstring)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "settings.py")
    spec = importlib.util.spec_from_file_location("_disttrain_entry_settings", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # NOTE: dataclasses looks the class's module up there
    spec.loader.exec_module(module)
    return module


settings = _load_settings()


def user_traceback(exc: BaseException, script: str) -> str:
    """The traceback text from the script's first frame on (runpy/_entry frames dropped)."""
    tb = exc.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != script:
        tb = tb.tb_next
    # NOTE: tb is None for errors raised before the script ran (SyntaxError while
    # compiling it); format_exception then prints just the exception and its location.
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _chain(exc: BaseException):
    """`exc` and the exceptions it was raised from or while handling, outermost first."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def failure_kind(exc: BaseException) -> str:
    """`timeout` or `peer-lost` when `exc` is a collective failing because of another rank;
    `exit` for sys.exit with a nonzero code; `exception` for the rank's own error."""
    if isinstance(exc, SystemExit):
        return "exit"
    for err in _chain(exc):
        kind = getattr(err, "disttrain_failure", None)
        if kind in ("timeout", "peer-lost"):
            return kind
        if isinstance(err, RuntimeError):  # torch.distributed called directly
            if _TIMED_OUT.search(str(err)):
                return "timeout"
            if _PEER_LOST.search(str(err)):
                return "peer-lost"
    return "exception"


def exit_code(exc: SystemExit) -> int:
    """The process exit code `sys.exit(exc.code)` gives."""
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 1


def record(exc: BaseException, script: str, error_file: str) -> bool:
    """Write `exc` to `error_file` (torch elastic's layout); False if that failed."""
    now = time.time()
    kind = failure_kind(exc)
    if kind == "exit":
        message = f"SystemExit: sys.exit({exc.code!r})"
    else:
        message = f"{type(exc).__name__}: {exc}"
    info = {
        "py_callstack": user_traceback(exc, script),
        "timestamp": str(int(now)),
        # finer than torch's whole seconds: the launcher orders failures by it
        "disttrain_time": repr(now),
        "disttrain_kind": kind,
    }
    if kind == "exit":
        info["disttrain_exit_code"] = exit_code(exc)
    data = {"message": {"message": message, "extraInfo": info}}
    try:
        with open(error_file, "w") as fp:
            json.dump(data, fp)
    except OSError:
        return False
    return True


def _restart_follows() -> bool:
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    return restarts < int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0))


def enable_stack_dumps(report_dir: str, rank: str, attempt: str):
    """Dump all threads' stacks to the report folder on SIGTERM and on crashes.

    NOTE: the file name must match disttrain.comm.flight.report_path (this file
    imports no disttrain module). Left alone when the user enabled faulthandler
    or handles SIGTERM already. Returns the open file (it must stay open).
    """
    if faulthandler.is_enabled() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        return None
    try:
        fp = open(os.path.join(report_dir, f"rank{rank}.a{attempt}.stacks"), "w")
    except OSError:
        return None
    faulthandler.enable(fp, all_threads=True)
    # chain=True: after the dump the default action runs, so SIGTERM still ends the rank.
    faulthandler.register(signal.SIGTERM, fp, all_threads=True, chain=True)
    return fp


def _ps_role() -> str | None:
    """"worker" or "server" for a rank of a parameter-server job, else None."""
    servers = settings.current().servers
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    return None if servers <= 0 else "worker" if rank < world - servers else "server"


def supervise(argv: list[str], role: str) -> int:
    """Run this rank in a child (blocks). A worker killed by SIGKILL ends the rank with 0;
    so does a server whose copies take over (the child said so in a file: ps/connect.py);
    any other server's SIGKILL ends this process the same way, as if unsupervised.

    NOTE: the agent stops a rank with killpg on its process group, which the child
    shares, so job shutdown and Ctrl-C still reach it without forwarding.
    """
    env = {**os.environ, settings.SUPERVISED: "1"}
    # NOTE: in the launcher's scratch folder: a SIGTERMed supervisor skips its `finally`
    fd, said = tempfile.mkstemp(prefix="disttrain-takeover-", dir=settings.current().scratch)
    os.close(fd)
    env[settings.PS_TAKEOVER_FILE] = said
    try:
        code = subprocess.call([sys.executable, "-u", os.path.abspath(__file__), *argv], env=env)
        with open(said) as f:
            taken = f.read().strip()
    finally:
        os.remove(said)
    rank = os.environ.get("RANK", "?")
    if code == -signal.SIGKILL and role == "worker":
        sys.stderr.write(
            f"disttrain: parameter-server worker rank {rank} was killed "
            "(SIGKILL); the job goes on without it: the servers' policy decides (Sync stops "
            "with an error that names it)\n")
        return 0
    if code == -signal.SIGKILL and taken:
        sys.stderr.write(f"disttrain: server rank {rank} killed (SIGKILL); its replicas take "
                         f"over ({taken}): the job goes on\n")
        return 0
    if code == -signal.SIGKILL:  # NOTE: the agent sees what it saw before supervision
        index = (int(os.environ.get("RANK", 0)) - int(os.environ.get("WORLD_SIZE", 1))
                 + settings.current().servers)
        sys.stderr.write(f"disttrain: server rank {rank} (server {index}) killed (SIGKILL); no "
                         "copy takes its keys over (replicas=1, or no server manager): the "
                         "attempt stops (--max-restarts N restarts it from its snapshots)\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return 128 - code if code < 0 else code


def main(argv: list[str]) -> int:
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    try:
        s = settings.current()
    except settings.SettingsError as err:
        print(f"disttrain: error: {err}", file=sys.stderr)
        return 2
    if _ps_role() and not s.supervised:
        return supervise(argv, _ps_role())
    script, run = _target(argv)
    if s.report_dir:
        _dumps = enable_stack_dumps(s.report_dir, os.environ.get("RANK", "0"),  # noqa: F841
                                    os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    try:
        run()
    except KeyboardInterrupt:
        return 130  # the launcher is shutting the job down and says so itself
    except SystemExit as exc:
        if exit_code(exc) != 0:  # the launcher says which rank chose to exit, and where
            error_file = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
            if error_file:
                record(exc, script, error_file)
        raise
    except Exception as exc:  # noqa: BLE001 - everything the script raises is reported
        return fail(exc, script)
    return 0


def check_module(name: str) -> None:
    """A ValueError saying how to fix `name` unless its top package is found from here, as
    `python -m name` would look (the current folder first). Imports nothing."""
    top = name.split(".")[0]
    if not all(part.isidentifier() for part in name.split(".")):
        raise ValueError(f"-m {name!r} is not a module name; give one as pkg.module (or drop -m "
                         "and give the path of a .py file)")
    if importlib.machinery.PathFinder.find_spec(top, [os.getcwd(), *sys.path[1:]]) is None:
        raise ValueError(f"-m {name}: no module named {top!r} from {os.getcwd()}; run from the "
                         "folder that holds it (or install it), or give the path of a .py file")


def _target(argv: list[str]):
    """(the file the rank runs, a call running it as `__main__`), with sys.argv and sys.path
    as `python script.py args` or `python -m module args` sets them."""
    if argv[0] == "-m" and len(argv) > 1:
        # NOTE: `python -m` puts the current folder first on sys.path, where this file's
        # folder (the disttrain package) is now; sys.argv[0] becomes the module's file.
        sys.path[0] = os.getcwd()
        sys.argv = [argv[1], *argv[2:]]
        try:
            spec = importlib.util.find_spec(argv[1])
            if spec is not None and spec.submodule_search_locations is not None:
                spec = importlib.util.find_spec(argv[1] + ".__main__")
            script = os.path.abspath(spec.origin) if spec and spec.origin else ""
        except ImportError:
            script = ""  # run_module raises it again, as `python -m` reports it
        return script, lambda: runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    script = os.path.abspath(argv[0])
    sys.argv = [argv[0], *argv[1:]]
    # NOTE: `python script.py` puts the script's folder first on sys.path; replace this
    # file's folder (the disttrain package) so the script imports what it would alone.
    sys.path[0] = os.path.dirname(script)
    return script, lambda: runpy.run_path(script, run_name="__main__")


def fail(exc: Exception, script: str) -> int:
    """Record the script's exception; return the rank's exit code (or end the process)."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    recorded = bool(error_file) and record(exc, script, error_file)
    # The launcher prints the recorded traceback once the job ends; print it here
    # too when nothing will (no error file) or when a restart follows (the job
    # goes on, and this attempt's error would otherwise never be seen).
    if not recorded or _restart_follows():
        sys.stderr.write(user_traceback(exc, script))
    sys.stdout.flush()
    sys.stderr.flush()
    if failure_kind(exc) == "peer-lost" and settings.current().report_dir:
        # NOTE: a consequence, not a cause: let the rank that left end first (see the
        # module docstring). The agent stops this rank as soon as that one has ended.
        time.sleep(peer_grace())
    code = getattr(exc, "disttrain_exit_code", None)
    if isinstance(code, int):
        os._exit(code)
    return 1


def peer_grace() -> float:
    """Seconds a rank whose peer left waits before exiting (DISTTRAIN_PEER_GRACE)."""
    return settings.current().peer_grace


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
