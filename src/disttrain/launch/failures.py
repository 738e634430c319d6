"""What `disttrain run` prints when ranks fail: the rank that caused it first, then the rest.

Who talks to whom: launch/job.py hands `report_failures` torch elastic's ProcessFailure per
failed rank (exit code, pid, the error file `entry.py` wrote) and the job's report
folder; hang_report.py reads every rank's flight-recorder state from that folder.

Each failed rank is classified by what it recorded, not by how it ended (the agent
SIGTERMs every other rank as soon as one fails): causes `exception`, `exit`, `signal`,
`code`; consequences `peer-lost`, `timeout`, `stopped`. The cause is the earliest
exception, else the earliest other cause: its traceback comes first, then one line
saying where the other ranks waited. With none, a timeout prints the merged hang report
(exit 124); ranks that only lost a peer print the same report under a headline saying
that a rank left. Why, and every case: docs/design/launcher.md, "What the launcher shows
when ranks fail".
"""

from __future__ import annotations

import io
import json
import signal
from dataclasses import dataclass

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from disttrain.comm.flight import EXIT_HANG, format_ranks
from disttrain.launch.hang_report import BACKEND_ERROR, collective_report, describe, load_states

__all__ = ["PREFIX_TEMPLATE", "RankFailure", "classify", "node_report", "rank_prefix", "report_failures"]

PREFIX_TEMPLATE = "[rank${rank}]: "
CAUSES = ("exception", "exit", "signal", "code")


def rank_prefix(rank: int) -> str:
    """The prefix on every output line of `rank` (and of its traceback on failure)."""
    return PREFIX_TEMPLATE.replace("${rank}", str(rank))


@dataclass
class RankFailure:
    """One failed rank as the launcher understands it."""

    rank: int
    exitcode: int
    """As torch elastic reports it: negative for a signal."""
    pid: int
    kind: str
    """exception | exit | signal | code (causes); peer-lost | timeout | stopped."""
    message: str
    """`Type: text` of the recorded exception, or ''."""
    callstack: str
    """The recorded traceback (user frames), or ''."""
    time: float
    """When it failed: recorded by the rank (sub-second), else when the agent saw it."""
    code: int
    """The launcher's exit code if this rank is the cause."""

    def ended(self) -> str:
        """How the rank ended, after 'rank N ...'."""
        if self.kind == "exception":
            return "exited (exception)"
        if self.kind == "exit":
            return f"exited ({self.message.removeprefix('SystemExit: ')})"
        if self.kind == "signal":
            return f"was killed by {_signal_name(-self.exitcode)}"
        return f"exited with code {self.exitcode}"


def classify(rank: int, failure: ProcessFailure) -> RankFailure:
    """What `failure` (torch elastic's record of one rank) means; see the module docstring."""
    message = failure.error_file_data.get("message")
    text = message.get("message", "") if isinstance(message, dict) else ""
    extra = message.get("extraInfo", {}) if isinstance(message, dict) else {}
    kind = extra.get("disttrain_kind") or _legacy_kind(text)
    code = failure.exitcode
    if kind is None:  # nothing recorded: the exit code is all there is
        if code == -signal.SIGTERM:
            kind = "stopped"
        elif code == EXIT_HANG:
            kind = "timeout"  # the flight recorder's watchdog (os._exit, no record)
        else:
            kind = "signal" if code < 0 else "code"
    if kind == "exit":
        launcher_code = int(extra.get("disttrain_exit_code", 1))
    elif kind == "signal":
        launcher_code = 128 - code
    elif kind == "code":
        launcher_code = code
    else:
        launcher_code = EXIT_HANG if kind == "timeout" else 1
    return RankFailure(rank, code, failure.pid, kind, text, extra.get("py_callstack", ""),
                       float(extra.get("disttrain_time", failure.timestamp)), launcher_code)


def _legacy_kind(text: str) -> str | None:
    """Kind of an error recorded without `disttrain_kind` (torch's own @record)."""
    if not text:
        return None
    if text.startswith("CollectiveError") or BACKEND_ERROR.search(text):
        return "timeout" if "timed out" in text.lower() else "peer-lost"
    return "exception"


def cause(failed: list[RankFailure]) -> RankFailure | None:
    """The rank that caused the failure: the earliest exception, else the earliest other cause."""
    causes = [f for f in failed if f.kind in CAUSES]
    return min(causes, key=lambda f: (f.kind != "exception", f.time, f.rank), default=None)


def report_failures(failures: dict[int, ProcessFailure], out, report_dir: str | None = None,
                    world_size: int = 0) -> int:
    """Print why the job failed (cause first); return the launcher's exit code.

    With a cause: its traceback (rank-prefixed), then other ranks that raised too, then
    one line saying where the other ranks waited when it left. Without one: the merged
    report of every rank's flight recorder; EXIT_HANG (124) if a collective timed out.
    """
    failed = sorted((classify(r, f) for r, f in failures.items()), key=lambda f: (f.time, f.rank))
    root = cause(failed)
    states = load_states(report_dir)[1] if report_dir else {}
    if root is None:
        world = max(world_size, max(failures) + 1)
        report = collective_report(report_dir, {f.rank: f.exitcode for f in failed}, world,
                                   {f.rank: (f.message, f.callstack) for f in failed}) if report_dir else None
        if report:
            out.write(report)
            out.flush()
            return EXIT_HANG if any(f.kind == "timeout" for f in failed) else 1
        root = failed[0]  # nothing recorded anywhere: say what there is
    _print_cause(root, out, report_dir)
    _print_others(root, failed, states, out)
    out.flush()
    return root.code


def node_report(failures: dict[int, ProcessFailure], report_dir: str, world_size: int,
                path: str) -> int:
    """Under `disttrain run --cluster`: write this node's report and its cause to `path` (JSON).

    NOTE: every node's agent sees only its own ranks, and the rank that raised may be on a
    node that ends after the nodes whose ranks lost it as a peer; the cluster's driver
    (launch/cluster_run.py) reads every node's file and prints the cause's report first.
    """
    text = io.StringIO()
    code = report_failures(failures, text, report_dir, world_size)
    failed = [classify(r, f) for r, f in failures.items()]
    root = cause(failed)
    summary = {"code": code, "report": text.getvalue(), "kind": root and root.kind,
               "time": root and root.time, "rank": root and root.rank, "world": world_size,
               "ranks": {f.rank: [f.exitcode, f.message, f.callstack] for f in failed}}
    with open(path, "w") as f:
        json.dump(summary, f)
    return code


def _print_cause(root: RankFailure, out, report_dir: str | None) -> None:
    prefix = rank_prefix(root.rank)
    if root.kind == "exception":
        out.write(f"disttrain run: rank {root.rank} raised an exception (pid {root.pid}):\n")
    else:
        out.write(f"disttrain run: rank {root.rank} {root.ended()} (pid {root.pid})\n")
    if root.callstack:
        out.writelines(prefix + line + "\n" for line in root.callstack.rstrip("\n").split("\n"))
        return
    crash = _crash_dump(root, report_dir)
    if crash:  # a crash (SIGSEGV, SIGABRT, ...): the stacks faulthandler wrote (entry.py)
        out.write(f"{prefix}no Python exception; the rank's threads when it died:\n")
        out.writelines(prefix + line + "\n" for line in crash.rstrip("\n").split("\n"))
    elif root.exitcode == -signal.SIGKILL:
        out.write(f"{prefix}no Python exception: SIGKILL cannot be caught (the kernel's OOM killer, "
                  "`kill -9`, a lost machine); see this rank's output above\n")
    else:
        out.write(f"{prefix}no Python exception was recorded (os._exit, a C library's exit or a "
                  "crash); see this rank's output above\n")


def _crash_dump(root: RankFailure, report_dir: str | None) -> str:
    if not report_dir or root.exitcode >= 0:
        return ""
    return load_states(report_dir)[2].get(root.rank, "").strip()


def _print_others(root: RankFailure, failed: list[RankFailure], states: dict, out) -> None:
    """Other causes one line each (same message folded), then where the rest waited."""
    same: dict[str, list[int]] = {}
    for f in failed:
        if f is not root and f.kind in CAUSES:
            same.setdefault(f.message or f.ended(), []).append(f.rank)
    for what, ranks in same.items():
        out.write(f"disttrain run: {_ranks(ranks)} also failed: {what}\n")
    mentioned = {root.rank, *(r for ranks in same.values() for r in ranks)}
    waits: dict[str, list[int]] = {}
    for rank, state in sorted(states.items()):
        flying = (state or {}).get("in_flight") or []
        if rank not in mentioned and flying:
            waits.setdefault(describe(flying[0], with_group=flying[0]["group"] != "world"), []).append(rank)
    if waits:
        where = "; ".join(f"{_ranks(r)} waited in {w}" for w, r in waits.items())
        mentioned.update(r for ranks in waits.values() for r in ranks)
        them = "them" if len(mentioned) > 2 else "it"
        out.write(f"disttrain run: rank {root.rank} {root.ended()} while {where}; "
                  f"the launcher stopped {them}\n")
    stopped = [f.rank for f in failed if f.rank not in mentioned]
    if stopped:
        out.write(f"disttrain run: stopped {_ranks(stopped)} after rank {root.rank} failed\n")


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"
