"""What `disttrain run` prints when ranks fail: tracebacks with rank prefixes, or one hang report.

Who talks to whom: launch.py hands `report_failures` torch elastic's ProcessFailure per
failed rank (exit code, pid, the error file `_entry.py` wrote) and the job's report
folder; when a rank failed inside a collective, comm/hang_report.py merges every rank's
flight-recorder state and stacks into one report.
"""

from __future__ import annotations

import signal

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from disttrain.comm.flight import EXIT_HANG
from disttrain.comm.hang_report import BACKEND_ERROR, collective_report, load_states

__all__ = ["PREFIX_TEMPLATE", "rank_prefix", "report_failures"]

PREFIX_TEMPLATE = "[rank${rank}]: "


def rank_prefix(rank: int) -> str:
    """The prefix on every output line of `rank` (and of its traceback on failure)."""
    return PREFIX_TEMPLATE.replace("${rank}", str(rank))


def _order(item: tuple[int, ProcessFailure]) -> tuple:
    rank, failure = item
    extra = _extra_info(failure)
    when = float(extra.get("disttrain_time", failure.timestamp))
    # Ranks with a recorded exception first: a killed rank is usually a consequence;
    # of those, a collective that failed is usually a consequence of another rank's error;
    # of the others, SIGTERM last: it is how the agent stops the healthy ranks.
    stopped = failure.exitcode == -signal.SIGTERM
    return ("py_callstack" not in extra, stopped, _is_collective_error(failure), when, rank)


def _message(failure: ProcessFailure) -> str:
    message = failure.error_file_data.get("message")
    return message.get("message", "") if isinstance(message, dict) else ""


def _is_collective_error(failure: ProcessFailure) -> bool:
    """Failed inside a collective (recorded or straight through torch.distributed)."""
    text = _message(failure)
    return (text.startswith("CollectiveError") or failure.exitcode == EXIT_HANG
            or bool(BACKEND_ERROR.search(text)))


def _extra_info(failure: ProcessFailure) -> dict:
    message = failure.error_file_data.get("message")
    return message.get("extraInfo", {}) if isinstance(message, dict) else {}


def _describe_exit(failure: ProcessFailure) -> str:
    if failure.exitcode < 0:
        return f"was killed by signal {failure.signal_name()}"
    return f"exited with code {failure.exitcode}"


def report_failures(failures: dict[int, ProcessFailure], out, report_dir: str | None = None,
                    world_size: int = 0) -> int:
    """Print the first failure's traceback, rank-prefixed, and one line per other failure.

    When a rank failed inside a collective (timeout or a peer gone), print instead the
    merged report of every rank's flight recorder (unless another rank's own exception
    came first: then that traceback, then the report). Returns the exit code for the
    launcher: the first failing rank's (at least 1), EXIT_HANG for a collective failure.
    """
    ordered = sorted(failures.items(), key=_order)
    rank, first = ordered[0]
    hang = None
    if report_dir:
        codes = {r: f.exitcode for r, f in failures.items()}
        errors = {r: (_message(f), _extra_info(f).get("py_callstack", "")) for r, f in failures.items()}
        hang = collective_report(report_dir, codes, max(world_size, max(failures) + 1), errors)
    if hang and _is_collective_error(first):
        out.write(hang)
        _other_failures(ordered, rank, out, skip_collective=True)
        out.flush()
        return EXIT_HANG
    _print_first(rank, first, out, report_dir)
    _other_failures(ordered[1:], rank, out)
    if hang:
        out.write(hang)
    out.flush()
    code = first.exitcode
    return code if code > 0 else (128 - code if code < 0 else 1)


def _print_first(rank: int, first: ProcessFailure, out, report_dir: str | None = None) -> None:
    prefix = rank_prefix(rank)
    out.write(f"disttrain run: rank {rank} {_describe_exit(first)} (pid {first.pid})\n")
    callstack = _extra_info(first).get("py_callstack")
    if callstack:
        out.writelines(prefix + line + "\n" for line in callstack.rstrip("\n").split("\n"))
        return
    crash = _crash_dump(rank, first, report_dir)
    if crash:  # a crash (SIGSEGV, SIGABRT, ...): the stacks faulthandler wrote (_entry.py)
        out.write(f"{prefix}no Python exception; the rank's threads when it died:\n")
        out.writelines(prefix + line + "\n" for line in crash.rstrip("\n").split("\n"))
    else:
        out.write(f"{prefix}no Python exception was recorded (sys.exit, os._exit or a crash); see this rank's output above\n")


def _crash_dump(rank: int, failure: ProcessFailure, report_dir: str | None) -> str:
    if not report_dir or failure.exitcode >= 0 or failure.exitcode == -signal.SIGTERM:
        return ""
    return load_states(report_dir)[2].get(rank, "").strip()


def _other_failures(ordered, rank: int, out, skip_collective: bool = False) -> None:
    """One line per other failed rank; the agent's SIGTERMs folded into one line."""
    stopped = []
    for other_rank, failure in ordered:
        message = failure.error_file_data.get("message")
        if skip_collective and (_is_collective_error(failure) or failure.exitcode == -signal.SIGTERM):
            continue  # the merged report shows these
        if isinstance(message, dict):
            out.write(f"disttrain run: rank {other_rank} also failed: {message['message']}\n")
        elif failure.exitcode == -signal.SIGTERM:
            stopped.append(str(other_rank))  # the agent's own shutdown signal
        else:
            out.write(f"disttrain run: rank {other_rank} also {_describe_exit(failure)}\n")
    if stopped:
        out.write(f"disttrain run: stopped rank(s) {', '.join(stopped)} after rank {rank} failed\n")


