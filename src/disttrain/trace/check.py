"""Check a trace against the Chrome trace-event format, and that every track nests.

`problems(trace)` returns what is wrong, in words (an empty list: valid): the top level
(an object with a `traceEvents` list, or a bare list), every event's fields by phase
(types, required fields, known phases and metadata names), complete ("X") spans on each
(pid, tid) track either disjoint or nested (Perfetto and chrome://tracing draw a track
as a stack: a span that half-overlaps another is drawn wrong), and flow events ("s",
"f") bound to a span on their track and paired by id. Used by the tests and by anyone
who post-processes a trace.
"""

from __future__ import annotations

import json
import numbers
from collections import defaultdict

__all__ = ["problems", "nesting_problems"]

PHASES = set("XBEiIsftCbenMPOND") | {"(", ")"}
METADATA = {"process_name", "process_labels", "process_sort_index", "thread_name",
            "thread_sort_index", "process_uptime_seconds"}
TOLERANCE_US = 0.01


def _num(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _event_problems(i: int, e) -> list[str]:
    if not isinstance(e, dict):
        return [f"event {i}: not an object"]
    where = f"event {i} ({e.get('name', '?')!r}, ph {e.get('ph')!r})"
    out = []
    ph = e.get("ph")
    if ph not in PHASES:
        return [f"{where}: unknown phase"]
    for key in ("pid", "tid"):
        if key in e and not isinstance(e[key], (int, str)):
            out.append(f"{where}: {key} must be an integer or string")
    if "pid" not in e:
        out.append(f"{where}: no pid")
    if not isinstance(e.get("name", ""), str):
        out.append(f"{where}: name must be a string")
    if "args" in e and not isinstance(e["args"], dict):
        out.append(f"{where}: args must be an object")
    if ph == "M":
        if e.get("name") not in METADATA:
            out.append(f"{where}: unknown metadata name")
        return out
    if not _num(e.get("ts")):
        out.append(f"{where}: ts must be a number (microseconds)")
    if ph == "X" and not (_num(e.get("dur")) and e["dur"] >= 0):
        out.append(f"{where}: a complete event needs dur >= 0")
    if ph in ("X", "B", "s", "f", "t", "i", "I") and "tid" not in e:
        out.append(f"{where}: no tid")
    if ph in ("s", "f", "t", "b", "e", "n") and not isinstance(e.get("id"), (int, str)):
        out.append(f"{where}: needs an id")
    if ph in ("s", "f", "t") and not isinstance(e.get("cat"), str):
        out.append(f"{where}: a flow event needs a cat")
    if ph in ("i", "I") and e.get("s", "t") not in ("g", "p", "t"):
        out.append(f"{where}: instant scope must be g, p or t")
    if ph == "C" and not all(_num(v) for v in e.get("args", {}).values()):
        out.append(f"{where}: counter values must be numbers")
    return out


def nesting_problems(events: list[dict]) -> list[str]:
    """Spans ("X") on one (pid, tid) that overlap without one containing the other."""
    tracks: dict[tuple, list[tuple[float, float, str]]] = defaultdict(list)
    for e in events:
        if isinstance(e, dict) and e.get("ph") == "X" and _num(e.get("ts")) and _num(e.get("dur")):
            tracks[(e.get("pid"), e.get("tid"))].append((e["ts"], e["ts"] + e["dur"], e.get("name", "")))
    out = []
    for key, spans in tracks.items():
        spans.sort(key=lambda s: (s[0], -s[1]))
        stack: list[tuple[float, float, str]] = []
        for t0, t1, name in spans:
            while stack and stack[-1][1] <= t0 + TOLERANCE_US:
                stack.pop()
            if stack and t1 > stack[-1][1] + TOLERANCE_US:
                p0, p1, pname = stack[-1]
                out.append(f"pid {key[0]} tid {key[1]}: {name!r} [{t0:.3f}, {t1:.3f}] half-overlaps "
                           f"{pname!r} [{p0:.3f}, {p1:.3f}]")
                continue
            stack.append((t0, t1, name))
    return out


def _flow_problems(events: list[dict]) -> list[str]:
    spans: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            spans[(e.get("pid"), e.get("tid"))].append((e["ts"], e["ts"] + e["dur"]))
    ends: dict[object, set[str]] = defaultdict(set)
    out = []
    for e in events:
        if e.get("ph") in ("s", "f"):
            ends[e.get("id")].add(e["ph"])
            inside = any(t0 - TOLERANCE_US <= e["ts"] <= t1 + TOLERANCE_US
                         for t0, t1 in spans[(e.get("pid"), e.get("tid"))])
            if not inside:
                out.append(f"flow {e.get('id')} ({e['ph']}) at {e['ts']} is not inside a span "
                           f"of pid {e.get('pid')} tid {e.get('tid')}")
    for fid, phases in ends.items():
        if phases != {"s", "f"}:
            out.append(f"flow {fid}: only {sorted(phases)} (a flow needs an 's' and an 'f')")
    return out


def problems(trace) -> list[str]:
    """Everything wrong with `trace` (a parsed object, or a path to a JSON file)."""
    if isinstance(trace, str):
        try:
            with open(trace, encoding="utf-8") as fp:
                trace = json.load(fp)
        except ValueError as err:
            return [f"not valid JSON: {err}"]
    if isinstance(trace, dict):
        events = trace.get("traceEvents")
        if not isinstance(events, list):
            return ["top level: an object needs a 'traceEvents' list"]
        if trace.get("displayTimeUnit", "ms") not in ("ms", "ns"):
            return ["top level: displayTimeUnit must be 'ms' or 'ns'"]
    elif isinstance(trace, list):
        events = trace
    else:
        return ["top level: must be an object or a list of events"]
    out = [p for i, e in enumerate(events) for p in _event_problems(i, e)]
    if out:
        return out
    return nesting_problems(events) + _flow_problems(events)
