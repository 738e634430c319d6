"""Merge every traced process's file into one `DIR/trace.json` (and `DIR/metrics.jsonl`).

Standard library only: `disttrain run` calls it after the job, whatever its outcome, and
it must work on files a killed rank left half-written (a line that does not parse is
skipped and counted). Each process becomes one Chrome process (pid = global rank, plus
10000 x the restart attempt) named `rank R` or `rank R (server)`, with ` on nK` when it ran
on node K of a multi-node job (`otherData.processes` keeps each one's node and
`otherData.link_gbps` the cluster's link rate when known); timestamps get the
file's measured clock offset (clock.py) and are shifted so the trace starts at 0 (the
wall-clock start is kept in `otherData.start_unix_us`). Written to a temporary file and
renamed, so `trace.json` is either the old complete file or the new complete one.
`clear(DIR)` removes a previous run's files before a job (the launcher's side too). With
tensorboard installed, the metrics also become event files in DIR/tensorboard/ (tboard.py).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys

from disttrain.trace import tboard
from disttrain.trace.recorder import EPOCH_S
from disttrain.trace.rows import LANE, assign_lanes, expand

__all__ = ["clear", "merge", "read_rank_file", "merge_and_tell"]


def clear(directory: str) -> None:
    """Create `directory` and remove a previous run's trace files from it (the launcher's job)."""
    os.makedirs(directory, exist_ok=True)
    for pattern in ("rank*.jsonl", "metrics.rank*.jsonl", "trace.json", "metrics.jsonl"):
        for path in glob.glob(os.path.join(directory, pattern)):
            os.remove(path)
    shutil.rmtree(os.path.join(directory, "tensorboard"), ignore_errors=True)


def read_rank_file(path: str) -> tuple[dict, list[dict], int]:
    """(header with its "clock", events on the process's own clock, lines or rows skipped) of
    one file; spans of communication get their lanes here (rows.assign_lanes)."""
    header: dict = {}
    events: list[dict] = []
    lanes: list[list[dict]] = []
    items: list = []
    skipped = 0
    with open(path, encoding="utf-8", errors="replace") as fp:
        for line in fp:
            try:
                obj = json.loads(line)
            except ValueError:
                skipped += 1  # NOTE: the last line of a killed rank may be cut short
                continue
            items.extend(obj if isinstance(obj, list) else [obj])  # a list: one flush (recorder.py)
    strings: dict[int, str] = {}
    for item in items:  # NOTE: the numbered strings first, wherever their rows landed
        if isinstance(item, list) and item and item[0] == "S" and expand(item, strings) is None:
            skipped += 1
    for item in items:
        if isinstance(item, list) and item and item[0] == "S":
            continue
        got = expand(item, strings)
        if got is None:
            skipped += 1
            continue
        for event in got:
            if "disttrain_trace" in event:
                header = event
            elif "clock" in event:
                header["clock"] = event["clock"]
            else:
                events.append(event)
        on_lane = [e for e in got if e.get("tid") == LANE]
        if on_lane:
            lanes.append(on_lane)
    events.extend(assign_lanes(lanes))
    return header, events, skipped


def _anchor(header: dict) -> float:
    """Where the file's clock reads 0 on rank 0's wall clock (µs since EPOCH_S)."""
    return float(header.get("wall0_us", 0.0)) + float((header.get("clock") or {}).get("offset_us", 0.0))


def _process_name(header: dict) -> str:
    name = f"rank {header.get('rank', '?')}"
    if header.get("role") == "server":
        name += " (server)"
    if header.get("node") is not None:
        name += f" on n{header['node']}"
    if header.get("attempt"):
        name += f" (attempt {header['attempt']})"
    return name


def _merge_metrics(directory: str, shifts: dict[tuple[int, int], float]) -> list[dict]:
    lines = []
    for path in glob.glob(os.path.join(directory, "metrics.rank*.jsonl")):
        with open(path, encoding="utf-8", errors="replace") as fp:
            for line in fp:
                try:
                    obj = json.loads(line)
                except ValueError:
                    continue
                if isinstance(obj, dict) and "step" in obj:
                    key = (obj.get("rank", 0), obj.get("attempt", 0))
                    obj["t0_s"] = (obj.pop("t0_us", 0.0) + shifts.get(key, 0.0)) / 1e6
                    lines.append(obj)
    lines.sort(key=lambda o: (o.get("attempt", 0), o["step"], o.get("rank", 0)))
    _write_atomic(os.path.join(directory, "metrics.jsonl"),
                  "".join(json.dumps(o, separators=(",", ":")) + "\n" for o in lines))
    return lines


def _paired_flows(events: list[dict]) -> list[dict]:
    """Drop flow ends whose other end is missing (cut by the step window or a crash)."""
    phases: dict[object, set] = {}
    for e in events:
        if e.get("ph") in ("s", "f"):
            phases.setdefault(e.get("id"), set()).add(e["ph"])
    return [e for e in events if e.get("ph") not in ("s", "f") or len(phases[e.get("id")]) == 2]


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fp:
        fp.write(text)
    os.replace(tmp, path)


def merge(directory: str) -> dict:
    """Write `directory/trace.json` and `metrics.jsonl` from the rank files; return a summary.

    The summary: path, processes, events, skipped lines, max clock error (µs), metric lines
    and the TensorBoard folder (None without tensorboard: tboard.py). Raises
    FileNotFoundError when `directory` holds no rank file (nothing is written then).
    """
    if not directory or not os.path.isdir(directory):
        raise FileNotFoundError(f"trace folder {directory!r} does not exist: give the folder "
                                "passed to --trace or disttrain.trace.start()")
    files = sorted(glob.glob(os.path.join(directory, "rank*.jsonl")))
    if not files:
        raise FileNotFoundError(f"no trace files (rank*.jsonl) in {directory}: no process of "
                                "the job started tracing there")
    read = [read_rank_file(path) for path in files]
    base = min((_anchor(h) for h, _, _ in read), default=0.0)
    events: list[dict] = []
    procs, skipped, max_error = [], 0, 0.0
    shifts: dict[tuple[int, int], float] = {}
    for header, evs, bad in read:
        skipped += bad
        rank, attempt = int(header.get("rank", 0)), int(header.get("attempt", 0))
        pid = rank + 10000 * attempt
        clock = header.get("clock") or {}
        shift = shifts[(rank, attempt)] = _anchor(header) - base
        max_error = max(max_error, float(clock.get("error_us", 0.0)))
        procs.append({"pid": pid, "rank": rank, "role": header.get("role", "worker"),
                      "attempt": attempt, "host": header.get("host"), "clock": clock,
                      **{k: header[k] for k in ("node", "link_gbps", "cost") if k in header}})
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": _process_name(header)}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                       "args": {"sort_index": pid}})
        for e in evs:
            e["pid"] = pid
            if "ts" in e:
                e["ts"] = round(e["ts"] + shift, 3)
            if "dur" in e:
                e["dur"] = round(e["dur"], 3)
        events.extend(evs)
    events = _paired_flows(events)
    trace = {"traceEvents": events, "displayTimeUnit": "ms",
             "otherData": {"producer": "disttrain", "start_unix_us": base + EPOCH_S * 1e6, "processes": procs,
                           "max_clock_error_us": max_error}}
    links = [p["link_gbps"] for p in procs if "link_gbps" in p]
    if links:  # NOTE: `disttrain run --cluster`'s link rate (Gbit/s), the report's reference
        trace["otherData"]["link_gbps"] = min(links)
    path = os.path.join(directory, "trace.json")
    _write_atomic(path, json.dumps(trace, separators=(",", ":")))
    lines = _merge_metrics(directory, shifts)
    board = tboard.write(directory, lines, trace["otherData"]["start_unix_us"] / 1e6)
    return {"path": path, "processes": len(procs), "events": len(events), "skipped_lines": skipped,
            "max_clock_error_us": max_error, "metric_lines": len(lines), "tensorboard": board}


def merge_and_tell(directory: str, out=None, who: str = "disttrain run") -> None:
    """Merge (the launcher's part, after any outcome) and say where the result is."""
    out = out or sys.stderr
    try:
        done = merge(directory)
    except OSError as err:
        print(f"{who}: could not merge the trace in {directory}: {err}", file=out, flush=True)
        return
    cut = f"; {done['skipped_lines']} cut lines skipped" if done["skipped_lines"] else ""
    print(f"{who}: trace of {done['processes']} processes ({done['events']} events{cut}) "
          f"in {done['path']} (open it in Perfetto's UI or chrome://tracing); "
          f"{done['metric_lines']} step lines in {os.path.join(directory, 'metrics.jsonl')}",
          file=out, flush=True)
