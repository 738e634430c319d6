"""Read a trace folder and say in words what limits the job (the report's first lines).

`load(DIR)` reads `metrics.jsonl` and `trace.json`; `summarize(run)` gives per-rank means
per step; `diagnose(run)` returns sentences, the most important first:

- a straggler: ranks of a synchronous job all show the same step time (the others wait
  for the slow one in exposed communication), so ranks are compared by their *own* time
  per step, `step_time - exposed_comm` (compute, data waits and idle). The slowest rank
  more than 25% above the median is named with the share of its gap that each part
  explains (`rank 3 is 41% slower than the median: 80% of the gap is data loading`), the
  named part of idle when one dominates (an injected delay, a checkpoint save);
- a pipeline bubble above 25%, with the stages and micro-batches the trace shows and the
  ideal bubble (p-1)/(m+p-1) of more micro-batches;
- exposed communication above 25% of the median step, with the bytes per collective and,
  when gradient buckets fire late, a bucket_mb computed from the trace (commstats.py);
- PS staleness (from the servers' final stats) and per-server load (applied updates), with
  a server's warning when its momentum and staleness are in the diverging range.

Standard library only; report.py draws the charts.
"""

from __future__ import annotations

import json
import os
import statistics
from collections import defaultdict

from disttrain.trace.commstats import bucket_advice, collectives

__all__ = ["load", "summarize", "diagnose", "pipeline_shape", "ps_servers", "collectives", "nodes"]

PARTS = ("compute", "exposed_comm", "data", "idle")
WORDS = {"compute": "compute", "exposed_comm": "exposed communication", "data": "data loading",
         "idle": "idle (outside traced work)"}
SLOW = 0.25
BUBBLE = 0.25
EXPOSED = 0.25


def load(directory: str) -> dict:
    """{"dir", "metrics": [lines], "events": [trace events], "other": otherData} of a trace folder."""
    metrics_path = os.path.join(directory, "metrics.jsonl")
    trace_path = os.path.join(directory, "trace.json")
    if not os.path.exists(trace_path):
        raise FileNotFoundError(f"{trace_path} not found: trace a job first (disttrain run "
                                f"--trace {directory} ...), or merge with disttrain.trace.merge")
    with open(trace_path, encoding="utf-8") as fp:
        tr = json.load(fp)
    events, other = tr["traceEvents"], tr.get("otherData") or {}
    metrics = []
    if os.path.exists(metrics_path):
        with open(metrics_path, encoding="utf-8") as fp:
            metrics = [json.loads(line) for line in fp if line.strip()]
    return {"dir": directory, "metrics": metrics, "events": events, "other": other}


def nodes(run: dict) -> dict[int, int]:
    """rank -> the node it ran on, for a multi-node job's trace (else empty)."""
    return {p["rank"]: p["node"] for p in run.get("other", {}).get("processes", [])
            if p.get("node") is not None}


def summarize(run: dict) -> dict[int, dict]:
    """rank -> mean seconds per step of each part, own time, steps, bubble, named idle."""
    by_rank: dict[int, list[dict]] = defaultdict(list)
    for m in run["metrics"]:
        by_rank[m["rank"]].append(m)
    out = {}
    for rank, lines in sorted(by_rank.items()):
        if len(lines) > 2:  # NOTE: the first step also pays for warm-up (allocations, sockets)
            lines = [m for m in lines if m["step"] != min(x["step"] for x in lines)]
        n = len(lines)
        row = {p: sum(m[p] for m in lines) / n for p in (*PARTS, "step_time")}
        row["own"] = row["step_time"] - row["exposed_comm"]
        row["steps"] = n
        named: dict[str, float] = defaultdict(float)
        for m in lines:
            for k, v in m.get("idle_named", {}).items():
                named[k] += v / n
        row["idle_named"] = dict(named)
        bubbles = [m["pipeline_bubble"] for m in lines if "pipeline_bubble" in m]
        if bubbles:
            row["pipeline_bubble"] = sum(bubbles) / len(bubbles)
        bytes_ = defaultdict(float)
        for m in lines:
            for k, v in m.get("bytes", {}).items():
                bytes_[k] += v / n
        row["bytes"] = dict(bytes_)
        out[rank] = row
    return out


def _straggler(rows: dict[int, dict]) -> str | None:
    if len(rows) < 2:
        return None
    median_own = statistics.median(r["own"] for r in rows.values())
    rank, row = max(rows.items(), key=lambda kv: kv[1]["own"])
    gap = row["own"] - median_own
    if median_own <= 0 or gap <= SLOW * median_own:
        return None
    diffs = {p: row[p] - statistics.median(r[p] for r in rows.values())
             for p in ("compute", "data", "idle")}
    positive = {p: d for p, d in diffs.items() if d > 0}
    total = sum(positive.values()) or 1.0
    part = max(positive, key=positive.get) if positive else "idle"
    what = WORDS[part]
    if part == "idle" and row["idle_named"]:
        name, secs = max(row["idle_named"].items(), key=lambda kv: kv[1])
        if secs >= 0.5 * diffs["idle"]:
            what = f"idle in '{name}'"
    return (f"rank {rank} is {100 * gap / median_own:.0f}% slower than the median: "
            f"{100 * positive.get(part, 0.0) / total:.0f}% of the gap is {what} "
            f"({1e3 * row['own']:.1f} ms of its own work per step vs a median of "
            f"{1e3 * median_own:.1f} ms; the other ranks wait for it)")


def pipeline_shape(events: list[dict]) -> tuple[int, int] | None:
    """(stages, micro-batches per step) seen in the trace's pipeline spans, if any."""
    stages, mbs = set(), set()
    for e in events:
        if e.get("cat") == "pipeline" and e.get("ph") == "X":
            stages.add(e["args"]["stage"])
            mbs.add(e["args"]["microbatch"])
    if not stages:
        return None
    return max(stages) + 1, max(mbs) + 1


def _bubble(rows: dict[int, dict], events: list[dict]) -> str | None:
    bubbles = {r: row["pipeline_bubble"] for r, row in rows.items() if "pipeline_bubble" in row}
    if not bubbles:
        return None
    mean = sum(bubbles.values()) / len(bubbles)
    if mean < BUBBLE:
        return None
    shape = pipeline_shape(events)
    if shape is None:
        return f"pipeline bubble is {100 * mean:.0f}% of the pipeline's time"
    p, m = shape
    ideal = (p - 1) / (m + p - 1)
    better = 4 * p
    return (f"pipeline bubble is {100 * mean:.0f}% of the pipeline's time (mean over stages): "
            f"{m} micro-batch{'es' if m > 1 else ''} over {p} stages (ideal bubble (p-1)/(m+p-1) = {100 * ideal:.0f}%); "
            f"use more micro-batches: {better} would make the ideal "
            f"{100 * (p - 1) / (better + p - 1):.0f}%")


def _exposed(rows: dict[int, dict], events: list[dict]) -> str | None:
    share = statistics.median(r["exposed_comm"] / r["step_time"] for r in rows.values()
                              if r["step_time"] > 0)
    if share < EXPOSED:
        return None
    kinds = defaultdict(float)
    for r in rows.values():
        for k, v in r["bytes"].items():
            kinds[k] += v / len(rows)
    ranked = sorted(kinds.items(), key=lambda kv: -kv[1])
    top = ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in ranked[:3])
    first = ranked[0][0] if ranked else ""
    buckets = bucket_advice(events)
    if buckets:
        hint = buckets
    elif first in ("send", "recv", "isend", "irecv"):
        hint = "stages wait for each other's activations and gradients (see the pipeline bubble)"
    elif first:
        hint = ("overlap it with compute (DataParallel buckets fire during backward; a smaller "
                "bucket_mb starts them earlier) or send fewer bytes (compression, a ZeRO stage)")
    else:
        hint = "workers wait for the parameter servers' answers (push/pull)"
    return (f"exposed communication is {100 * share:.0f}% of the median step"
            + (f" (per step and rank: {top})" if top else "") + f": {hint}")


def ps_servers(events: list[dict]) -> dict[int, dict]:
    """pid -> a server's final stats (staleness histogram, applied updates) and apply spans."""
    out: dict[int, dict] = {}
    for e in events:
        if e.get("name") == "ps server stats":
            out.setdefault(e["pid"], {}).update(e.get("args", {}))
        elif e.get("cat") == "ps" and e.get("name") == "apply" and e.get("ph") == "X":
            s = out.setdefault(e["pid"], {})
            s["apply_spans"] = s.get("apply_spans", 0) + 1
            s["apply_us"] = s.get("apply_us", 0.0) + e["dur"]
    return out


def _staleness(events: list[dict]) -> str | None:
    servers = ps_servers(events)
    hist: dict[int, int] = defaultdict(int)
    for s in servers.values():
        for k, v in (s.get("staleness") or {}).items():
            hist[int(k)] += int(v)
    if not hist:
        return None
    n = sum(hist.values())
    mean = sum(k * v for k, v in hist.items()) / n
    warned = [s["warning"] for _, s in sorted(servers.items()) if s.get("warning")]
    warning = (f"; WARNING ({len(warned)} of {len(servers)} servers; the first): {warned[0]}"
               if warned else "")
    return (f"parameter server: {n} pushes applied by {len(servers)} server(s), mean staleness "
            f"{mean:.2f} versions (max {max(hist)}){warning}")


def diagnose(run: dict) -> list[str]:
    """What limits the job, in words, the most important first."""
    rows = summarize(run)
    if not rows:
        return ["no step was recorded: the trace has no closed training step (the window "
                "--trace-steps may lie past the job's end, or the loop has no optimizer step: "
                "call disttrain.trace.end_step())"]
    slow = _straggler(rows)
    # NOTE: behind a straggler the others' exposed communication is waiting for it
    lines = [x for x in (slow, _bubble(rows, run["events"]), None if slow else _exposed(rows, run["events"])) if x]
    if not lines:
        med = statistics.median(r["step_time"] for r in rows.values())
        comp = statistics.median(r["compute"] / r["step_time"] for r in rows.values() if r["step_time"])
        lines.append(f"no single limit stands out: every rank's own work is within {100 * SLOW:.0f}% "
                     f"of the median; a step takes {1e3 * med:.1f} ms, {100 * comp:.0f}% of it compute")
    stale = _staleness(run["events"])
    if stale:
        lines.append(stale)
    return lines
