"""The compact rows a traced process writes, and the Chrome trace events the merge makes of them.

recorder.py appends rows (tuples: a kind, then the fields `ROWS` names) on the hot path;
`expand()` turns each into events at the merge, and `assign_lanes()` puts the spans of
communication on lanes. Standard library only.
"""

from __future__ import annotations

__all__ = ["ROWS", "expand", "assign_lanes", "thread_meta", "MAIN_TID", "COMM_TID", "LANE"]

MAIN_TID = 0
COMM_TID = 100
LANE = -1
"""The tid of an expanded event that the merge puts on a communication lane (`assign_lanes`)."""
ROWS = {
    "X": ("ts", "dur", "tid", "name", "cat", "args"),
    "i": ("ts", "tid", "name", "cat", "args"),
    "s": ("ts", "tid", "id"),
    "f": ("ts", "tid", "id"),
    "C": ("ts", "tid", "name", "args"),
    "K": ("ts", "dur", "op", "group", "ranks", "seq", "bytes", "site", "exposed"),
    "E": ("ts", "dur", "tid", "name", "op", "group", "seq"),
    "P": ("ts", "dur", "name", "microbatch", "chunk", "stage"),
    "L": ("ts", "dur", "name", "cat", "args", "flows"),
    "B": ("ts", "dur", "bucket", "bytes", "launched"),
    "S": ("id", "text"),
}
"""Compact rows [kind, *fields]: Chrome phases X, i, s, f, C (`args` may be null: none), and
spans without key names, the most frequent ones:
- K a collective of comm/ops.py from issue to completion (cat comm, name = op) on a
  communication lane; `exposed`: the track of the caller that blocked through all of it
  (its exposed span, cat comm.exposed, the same interval), else null; a point-to-point
  one's flow arrow end comes from its group ('p2p S->D') and seq;
- E the caller's wait for one (cat comm.exposed);
- P a pipeline action (cat pipeline, training thread);
- L any other span on a communication lane, with flow arrow ends [[phase, id], ...]
  bound to it (a parameter-server push or pull);
- B a DataParallel/ZeRO bucket from its last gradient's arrival to its wait's return, with
  its `reduce` (from `launched`) inside, both on one communication lane;
- S a string's number in this file: K and E rows give their names, ops, groups and call
  sites as these numbers (`_INTERNED`).

NOTE: numbers, because the C encoder's cost is mostly per string (a K row with four
strings took 3.2 us to encode, with numbers instead 0.95 us), and a job repeats a few
dozen names and call sites millions of times."""
_INTERNED = {"K": ("op", "group", "site"), "E": ("name", "op", "group")}
_SPAN = {"E": "comm.exposed", "P": "pipeline"}


def _flow_end(phase: str, fid, t0: float, dur: float) -> dict:
    """A flow arrow's end bound to the span [t0, t0 + dur] on its lane: a start at the
    span's start, a finish just before its end."""
    ts = t0 if phase == "s" else t0 + dur - min(1.0, dur / 2)
    return {"ph": phase, "name": "flow", "cat": "flow", "id": fid, "ts": ts, "tid": LANE, "bp": "e"}


def _p2p_flow(op: str, group: str, seq) -> tuple | None:
    """(phase, id) of a point-to-point message's arrow end: both ends number it the same (the
    flight recorder's per-direction sequence number); None for other groups."""
    if not group.startswith("p2p "):
        return None
    src, _, dst = group[4:].partition("->")
    try:
        fid = (int(src) * 4096 + int(dst)) * 2**28 + int(seq)  # NOTE: < 2**53: exact in JavaScript
    except ValueError:
        return None
    return ("s" if op in ("send", "isend") else "f", fid)


def expand(row, strings: dict | None = None) -> list[dict] | None:
    """The Chrome trace events of one element of a line: a row (`ROWS`) or a whole event;
    None for anything else. Events to go on a communication lane have tid `LANE`, the
    outermost first (`assign_lanes` gives them one). `strings`: the file's numbered strings,
    which an "S" row adds to (it has no event); a K or E row whose number is not there is None."""
    if isinstance(row, dict):
        return [row]
    fields = ROWS.get(row[0]) if isinstance(row, list) and row and isinstance(row[0], str) else None
    if fields is None or len(row) != len(fields) + 1:
        return None
    kind, event = row[0], dict(zip(fields, row[1:]))
    strings = {} if strings is None else strings
    try:
        if kind == "S":
            strings[int(event["id"])] = str(event["text"])
            return []
        for key in _INTERNED.get(kind, ()):
            if not isinstance(event[key], str):
                event[key] = strings[event[key]]
        return _EXPAND[kind](event) if kind in _EXPAND else _phase(kind, event)
    except (TypeError, ValueError, KeyError, AttributeError):
        return None


def _phase(kind: str, event: dict) -> list[dict]:
    event["ph"] = kind
    if event.get("args") is None:
        event.pop("args", None)
    if kind == "i":
        event["s"] = "t"
    elif kind in ("s", "f"):
        event.update(name="flow", cat="flow", bp="e")
    return [event]


def _collective(e: dict) -> list[dict]:
    args = {k: e[k] for k in ("op", "group", "ranks", "seq", "bytes", "site")}
    out = [{"ph": "X", "name": e["op"], "cat": "comm", "ts": e["ts"], "dur": e["dur"], "tid": LANE,
            "args": args}]
    flow = _p2p_flow(e["op"], e["group"], e["seq"])
    if flow is not None:
        out.append(_flow_end(*flow, e["ts"], e["dur"]))
    if e["exposed"] is not None:
        out.append({"ph": "X", "name": e["op"], "cat": "comm.exposed", "ts": e["ts"], "dur": e["dur"],
                    "tid": e["exposed"], "args": {k: e[k] for k in ("op", "group", "seq")}})
    return out


def _span(kind: str, keys: tuple):
    def make(e: dict) -> list[dict]:
        return [{"ph": "X", "name": e.get("name", e.get("op")), "cat": _SPAN[kind], "ts": e["ts"],
                 "dur": e["dur"], "tid": e.get("tid", MAIN_TID), "args": {k: e[k] for k in keys}}]
    return make


def _lane_span(e: dict) -> list[dict]:
    span = {"ph": "X", "name": e["name"], "cat": e["cat"], "ts": e["ts"], "dur": e["dur"], "tid": LANE}
    if e["args"] is not None:
        span["args"] = e["args"]
    return [span] + [_flow_end(phase, fid, e["ts"], e["dur"]) for phase, fid in e["flows"] or ()]


def _bucket(e: dict) -> list[dict]:
    done = e["ts"] + e["dur"]
    return [{"ph": "X", "name": f"bucket {e['bucket']}", "cat": "dp", "ts": e["ts"], "dur": e["dur"],
             "tid": LANE, "args": {"bucket": e["bucket"], "bytes": e["bytes"]}},
            {"ph": "X", "name": "reduce", "cat": "dp", "ts": e["launched"],
             "dur": max(0.0, done - e["launched"]), "tid": LANE}]


_EXPAND = {"K": _collective, "E": _span("E", ("op", "group", "seq")),
           "P": _span("P", ("microbatch", "chunk", "stage")), "L": _lane_span, "B": _bucket}


def assign_lanes(groups: list[list[dict]]) -> list[dict]:
    """Put each group of events (one row's: its outermost span first) on the first
    communication lane free from its start, in order of start; their tids set in place.
    Returns the lanes' metadata events ("comm", "comm 2", ...).

    NOTE: interval partitioning: a lane's spans never overlap, and no more lanes are used
    than spans are ever open at once."""
    ends: list[float] = []
    for group in sorted(groups, key=lambda g: g[0]["ts"]):
        t0, t1 = group[0]["ts"], group[0]["ts"] + group[0]["dur"]
        for lane, end in enumerate(ends):
            if end <= t0:
                ends[lane] = t1
                break
        else:
            lane = len(ends)
            ends.append(t1)
        for event in group:
            event["tid"] = COMM_TID + lane
    return [e for lane in range(len(ends))
            for e in thread_meta(COMM_TID + lane, "comm" if lane == 0 else f"comm {lane + 1}")]


def thread_meta(tid: int, name: str) -> list[dict]:
    """The metadata that names track `tid` and sorts it by its number."""
    return [{"ph": "M", "name": "thread_name", "tid": tid, "args": {"name": name}},
            {"ph": "M", "name": "thread_sort_index", "tid": tid, "args": {"sort_index": tid}}]
