"""Merge every rank's flight-recorder state into one report that names the cause of a hang.

Inputs, per rank, from the report folder `disttrain run` creates (DISTTRAIN_REPORT_DIR):
`rank{R}.a{A}.json`, the recorder's state (comm/flight.py: collectives in flight, recent
ones, status, stacks when it failed), `rank{R}.a{A}.live`, the collectives in flight at
this moment (comm/live.py; it overrides the JSON's, which a heartbeat writes), and `rank{R}.a{A}.stacks`, every thread's stack as
faulthandler wrote it when the rank was stopped or crashed (launch/entry.py enables it).
Output: per collective in flight, which ranks waited and which were missing, where each
rank is, then the stacks (an example: docs/design/launcher.md, "Report").

Who talks to whom: launch/failures.py calls `collective_report(report_dir, exit_codes)` when a
job fails; it reads files only (standard library), never contacts the ranks.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal

from disttrain.comm.flight import format_ranks, is_library
from disttrain.comm.live import read_live

__all__ = ["load_states", "collective_report", "describe", "parse_stack", "RankView"]

_FRAME = re.compile(r'File "(.+?)", line (\d+),? in (.+)')
# A rank's own error that says a collective failed in the backend (not the user's bug).
BACKEND_ERROR = re.compile(r"gloo|nccl|DistBackendError|DistNetworkError|Timed out waiting|"
                           r"Connection (closed|reset) by peer", re.IGNORECASE)
_TORCH_DIST = os.sep + os.path.join("torch", "distributed") + os.sep
COLLECTIVES = frozenset(
    "all_reduce broadcast all_gather all_gather_into_tensor reduce_scatter reduce_scatter_tensor "
    "barrier monitored_barrier send recv isend irecv gather scatter reduce all_to_all "
    "all_to_all_single all_gather_object broadcast_object_list batch_isend_irecv".split())
_NAME = re.compile(r"rank(\d+)\.a(\d+)\.(json|stacks|live)$")
MAX_FRAMES = 12


class RankView:
    """What the launcher knows about one rank: its state, its stack, its exit."""

    def __init__(self, rank: int, state: dict | None, fault: str | None, exitcode: int | None,
                 error: tuple[str, str] | None = None):
        self.rank, self.state, self.exitcode = rank, state, exitcode
        # NOTE: stack sources, best first: the rank's own exception traceback, the
        # recorder's dump when its collective failed, faulthandler at SIGTERM/crash
        # (exact, even inside C code; what a stopped rank has).
        message, callstack = error or ("", "")
        self.stack = parse_stack(callstack) if callstack else []
        if not self.stack and state and state.get("stacks"):
            stacks = state["stacks"]
            self.stack = parse_stack(stacks.get("MainThread") or next(iter(stacks.values())))
        if not self.stack and fault:
            self.stack = _main_stack(fault)
        self.error = (state or {}).get("error") or (message if BACKEND_ERROR.search(message) else "")

    def backend_trouble(self) -> bool:
        status = (self.state or {}).get("status")
        return status in ("timeout", "failed") or self.exitcode == 124 or bool(self.error)

    def in_flight(self) -> dict | None:
        flying = (self.state or {}).get("in_flight") or []
        return flying[0] if flying else None

    def last(self) -> dict | None:
        recent = (self.state or {}).get("recent") or []
        return recent[-1] if recent else None

    def where(self) -> str:
        """Position phrase after 'rank N is' / 'ranks a-b are'."""
        entry = self.in_flight()
        if entry:
            return "at " + describe(entry, with_group=entry["group"] != "world")
        last = self.last()
        after = f"last completed {describe(last)}" if last else "no collective completed yet"
        status = (self.state or {}).get("status")
        if status == "exited" and not self.exitcode:  # a failed script also runs atexit
            return f"done: its script returned ({after})"
        here = self.user_frame()
        spot = f" at {os.path.basename(here[0])}:{here[1]} in {here[2]}" if here else ""
        raw = self.torch_collective()
        if raw:
            return (f"in torch.distributed.{raw}{spot.replace(' at ', ' called at ', 1)} (not "
                    f"numbered: call disttrain.comm.{raw} instead to see which one)")
        code = self.exitcode
        if code is not None and code != 124 and code != -signal.SIGTERM and code != 0:
            how = f"killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
            return f"dead: {how}{spot} ({after})"
        if self.state is None:
            return f"outside any disttrain collective{spot} (it issued none)"
        return f"outside any collective{spot} ({after})"

    def torch_collective(self) -> str | None:
        """The torch.distributed collective the stack is inside, if any (unrecorded path)."""
        names = [f for p, _, f in self.stack if _TORCH_DIST in p and f in COLLECTIVES]
        return names[0] if names else None

    def user_frame(self) -> tuple[str, int, str] | None:
        for path, line, func in reversed(self.stack):
            if not is_library(path):
                return path, line, func
        return None


def describe(entry: dict, with_group: bool = False) -> str:
    text = f"{entry['op']} #{entry['seq']} ({os.path.basename(entry['site'])})"
    return f"{text} on {entry['group']}" if with_group else text


def parse_stack(text: str) -> list[tuple[str, int, str]]:
    """Frames (file, line, func), most recent call last, from a traceback-style text."""
    return [(m[1], int(m[2]), m[3].strip()) for m in _FRAME.finditer(text)]


def _main_stack(fault: str) -> list[tuple[str, int, str]]:
    """The main thread's frames from faulthandler output (most recent first there)."""
    blocks = [b for b in fault.split("\n\n") if "File " in b]
    # NOTE: faulthandler does not name threads; the main thread's stack runs the script
    # (`<module>`), worker threads start in threading's _bootstrap.
    main = next((b for b in blocks if " in <module>" in b), "")
    return list(reversed(parse_stack(main)))


def load_states(report_dir: str) -> tuple[int, dict[int, dict | None], dict[int, str]]:
    """(attempt, states, fault stacks) of the latest restart attempt found in `report_dir`."""
    found = [(_NAME.search(p), p) for p in glob.glob(os.path.join(report_dir, "rank*.a*.*"))]
    found = [(int(m[1]), int(m[2]), m[3], p) for m, p in found if m]
    if not found:
        return 0, {}, {}
    attempt = max(a for _, a, _, _ in found)
    states, faults, lives = {}, {}, {}
    for rank, a, kind, path in found:
        if a != attempt:
            continue
        if kind == "live":
            lives[rank] = read_live(path)
            continue
        try:
            with open(path) as fp:
                if kind == "json":
                    states[rank] = json.load(fp)
                else:
                    faults[rank] = fp.read()
        except (OSError, ValueError):
            continue  # a rank killed mid-write: its older state is gone, say nothing of it
    for rank, flying in lives.items():
        # NOTE: the live file is written as a collective starts and ends, the JSON state by
        # a heartbeat: the live file says where the rank waits, even if it was stopped
        # before its first heartbeat.
        if flying is not None and (flying or rank in states):
            state = states.get(rank) or {"rank": rank, "status": "running", "recent": [], "counts": []}
            state["in_flight"] = flying
            states[rank] = state
    return attempt, states, faults


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _slot_lines(views: list[RankView]) -> list[str]:
    """Per stuck collective: who waited, who is missing, and who issued something else."""
    by_slot: dict[tuple[str, int], list[tuple[RankView, dict]]] = {}
    for v in views:
        entry = v.in_flight()
        if entry:
            by_slot.setdefault((entry["group"], entry["seq"]), []).append((v, entry))
    lines = []
    for (group, seq), members in sorted(by_slot.items(), key=lambda kv: min(v.rank for v, _ in kv[1])):
        calls: dict[str, list[int]] = {}
        for v, e in members:
            calls.setdefault(describe(e), []).append(v.rank)
        expected = set(members[0][1]["ranks"])
        # NOTE: a p2p slot pairs a send with a receive: different ops there are no mismatch.
        if len(calls) > 1 and not group.startswith("p2p"):
            said = "; ".join(f"{_ranks(r)}: {c}" for c, r in calls.items())
            lines.append(f"mismatch at collective #{seq} on {group}: {said}. Every rank of a "
                         "group must issue the same collectives in the same order")
        for call, ranks in calls.items():
            missing = sorted(expected - set(ranks))
            lines.append(f"{call} on {group} (ranks {format_ranks(expected)}): {_ranks(ranks)} "
                         f"waited" + (f"; missing: {_ranks(missing)}" if missing else ""))
        lines += _count_lines(views, group, expected)
    return lines


def _count_lines(views: list[RankView], group: str, members: set[int]) -> list[str]:
    """Call sites issued a different number of times by the group's ranks (a skipped call)."""
    counts: dict[tuple[str, str], dict[int, int]] = {}
    known = [v for v in views if v.rank in members and v.state is not None]
    for v in known:
        for g, op, site, n in v.state.get("counts", []):
            if g == group:
                counts.setdefault((op, site), {})[v.rank] = n
    lines = []
    for (op, site), per_rank in sorted(counts.items()):
        by_n: dict[int, list[int]] = {}
        for v in known:
            by_n.setdefault(per_rank.get(v.rank, 0), []).append(v.rank)
        if len(by_n) > 1:
            said = " but ".join(f"{_times(n)} by {_ranks(r)}" for n, r in sorted(by_n.items(), reverse=True))
            lines.append(f"  {op} at {os.path.basename(site)} was issued {said}")
    return lines[:6]


def _times(n: int) -> str:
    return "never" if n == 0 else ("once" if n == 1 else f"{n} times")


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"


def _where_line(views: list[RankView]) -> str:
    groups: dict[str, list[int]] = {}
    for v in views:
        groups.setdefault(v.where(), []).append(v.rank)
    parts = sorted(groups.items(), key=lambda kv: min(kv[1]))
    return "; ".join(f"{_ranks(r)} {'is' if len(r) == 1 else 'are'} {w}" for w, r in parts)


def _stack_lines(v: RankView) -> list[str]:
    frames = v.stack
    # Drop the launcher's own frames below the user's script (launch/entry.py, runpy).
    user = [i for i, f in enumerate(frames) if not is_library(f[0])]
    if user:  # keep the library call the user's code made (a collective's name), drop the rest
        calls = [i for i, f in enumerate(frames) if i > user[-1] and f[2] in COLLECTIVES]
        frames = frames[user[0]:(calls[0] if calls else user[-1] + 1) + 1]
    if not frames:
        return [f"[rank{v.rank}]: no stack recorded"]
    shown = frames[-MAX_FRAMES:]
    out = [f"[rank{v.rank}]: stack (most recent call last):"]
    if len(frames) > len(shown):
        out.append(f"[rank{v.rank}]:   ... {len(frames) - len(shown)} outer frames")
    out += [f'[rank{v.rank}]:   File "{p}", line {n}, in {f}' for p, n, f in shown]
    return out


def _short(error: str) -> str:
    """First line of a backend error without gloo's source-location prefix."""
    first = error.splitlines()[0] if error else ""
    return re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\] ", "", first)[:200]


def _headline(views: list[RankView]) -> str:
    """What happened, in words: a timeout only when a collective timed out."""
    timed_out = [v for v in views if (v.state or {}).get("status") == "timeout"
                 or re.search(r"timed out", v.error, re.IGNORECASE)]
    if not timed_out:
        return "a collective failed because a rank left the job"
    limits = {v.state["timeout"] for v in timed_out if v.state and v.state.get("timeout")}
    for v in timed_out:  # unrecorded path: gloo says how long it waited
        m = re.search(r"Timed out waiting (\d+)ms", v.error)
        if m and not limits:
            limits.add(int(m[1]) / 1000)
    return f"a collective timed out after {min(limits):g} s" if limits else "a collective timed out"


def collective_report(report_dir: str, exit_codes: dict[int, int], world_size: int,
                      errors: dict[int, tuple[str, str]] | None = None) -> str | None:
    """The merged report text, or None when no rank failed inside a collective.

    `errors`: rank -> (message, traceback text) of the exceptions ranks recorded; a
    backend error there (gloo timeout, peer gone) counts even when the collective was
    issued straight through torch.distributed and so was not recorded.
    """
    _, states, faults = load_states(report_dir)
    errors = errors or {}
    views = [RankView(r, states.get(r), faults.get(r), exit_codes.get(r), errors.get(r))
             for r in range(world_size)]
    if not any(v.backend_trouble() for v in views):
        return None
    lines = [f"disttrain run: {_headline(views)}; where every rank was:"]
    lines += ["  " + line for line in _slot_lines(views)]
    lines.append("  " + _where_line(views))
    for v in views:
        if v.error:
            lines.append(f"[rank{v.rank}]: {_short(v.error)}")
    for v in views:
        lines += _stack_lines(v)
    return "\n".join(lines) + "\n"

