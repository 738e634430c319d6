"""What the communication achieved, from a merged trace: per collective and per bucket.

`collectives(events, other)` is the report's table: per collective kind the calls, bytes,
median time from issue to completion, achieved rate and bus bandwidth (nccl-tests'
convention), and its share of the cluster's link when `disttrain run --cluster` recorded
one (trace.json's otherData.link_gbps; groups inside one node do not use the link).
`bucket_advice(events)` reads DataParallel/ZeRO's bucket spans against backward: when the
gradient bytes become ready for reduction late in backward (bytes-weighted), it computes
a bucket_mb from the trace (the backward's length and the reduce rate achieved) and says
how. Standard library only; analysis.py puts both into the diagnosis and report.py shows
the table.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from collections.abc import Callable

__all__ = ["bus_factor", "collectives", "bucket_timing", "bucket_advice"]

LATE = 0.75
"""Buckets fire late when their bytes are ready, on average, this far through backward
(small buckets over a steady backward average about 0.5; one bucket at the end, 1)."""
TAIL = 0.1
"""The advised bucket reduces in this fraction of backward (what stays after backward)."""


def bus_factor(op: str, n: int) -> float:
    """Bytes each rank moves over its link per byte of the recorded tensor (nccl-tests' bus
    bandwidth): all-reduce 2(n-1)/n, reduce-scatter (n-1)/n of its input, all-gather n-1
    times its input, broadcast and point-to-point 1; 0 for what moves no data (barrier)."""
    if n < 2:
        return 0.0
    if op.startswith("all_reduce"):
        return 2 * (n - 1) / n
    if op.startswith("reduce_scatter"):
        return (n - 1) / n
    if op.startswith("all_gather"):
        return float(n - 1)
    return 1.0 if op in ("broadcast", "send", "recv", "isend", "irecv") else 0.0


def _members(group: str, ranks: list[int]) -> list[int]:
    """Global ranks of a recorded group name ('world', 'group [0-2,5]', 'p2p 0->1')."""
    if group.startswith("p2p "):
        return [int(r) for r in group[4:].split("->")]
    if group.startswith("group ["):
        out = []
        for part in group[7:].rstrip("]").split(","):
            a, _, b = part.partition("-")
            out += range(int(a), int(b or a) + 1)
        return out
    return ranks


def _crosses(other: dict) -> Callable[[str], bool | None]:
    """group name -> True (spans nodes: uses the link), False (one node), None (unknown)."""
    node = {p["rank"]: p["node"] for p in other.get("processes", []) if "node" in p}
    ranks = sorted(node)
    if not node:
        return lambda group: None
    return lambda group: len({node[r] for r in _members(group, ranks) if r in node}) > 1


def collectives(events: list[dict], other: dict | None = None) -> list[dict]:
    """Per collective kind and message size (a median over mixed sizes would price none of
    them): calls, bytes per call, median time issue -> completion, the
    achieved rate (tensor bytes / median time), the bus bandwidth (`bus_factor`) and, when
    the trace knows the cluster's link (`other`: trace.json's otherData), its share of it
    (None for groups inside one node, which do not use the link)."""
    other = other or {}
    link, crosses = other.get("link_gbps"), _crosses(other)
    by_op: dict[tuple, list[tuple[float, int, int]]] = defaultdict(list)
    for e in events:
        a = e.get("args", {})
        if e.get("ph") == "X" and e.get("cat") == "comm" and "bytes" in a:
            by_op[(e["name"], crosses(a.get("group", "")), a["bytes"])].append(
                (e["dur"], a["bytes"], a.get("ranks", 0)))
    out = []
    for (op, cross, _), calls in sorted(by_op.items(), key=lambda kv: (kv[0][0], str(kv[0][1]), kv[0][2])):
        dur = statistics.median(d for d, _, _ in calls)
        nbytes = statistics.median(b for _, b, _ in calls)
        n = max(x for _, _, x in calls)
        bus = 8e-3 * nbytes * bus_factor(op, n) / dur if dur > 0 else 0.0  # Gbit/s
        out.append({"op": op, "calls": len(calls), "bytes": nbytes, "median_us": dur, "n": n,
                    "mb_per_s": nbytes / dur if dur > 0 else 0.0, "bus_gbps": bus,
                    "crosses_nodes": cross,
                    "link_share": bus / link if link and cross is not False and bus else None})
    return out




def _kind(e: dict) -> str | None:
    if e.get("ph") != "X":
        return None
    cat, name = e.get("cat"), e.get("name", "")
    if (cat == "compute" and name == "backward") or (cat == "pipeline" and name[:1] in ("B", "W")):
        return "backward"
    if cat == "dp" and name.startswith("bucket "):
        return "bucket"
    return "comm" if cat == "comm" and "bytes" in e.get("args", {}) else None


def _reduce_of(bucket: dict, comm: list[dict], starts: list[float]) -> dict | None:
    """The collective that reduced `bucket`: issued inside its span, of its size."""
    end = bucket["ts"] + bucket["dur"]
    for c in comm[bisect.bisect_left(starts, bucket["ts"]):]:
        if c["ts"] > end:
            return None
        if c["args"]["bytes"] == bucket["args"]["bytes"]:
            return c
    return None


def bucket_timing(events: list[dict]) -> dict | None:
    """Gradient buckets against backward (every rank and step): bytes per step (median),
    `ready_at`: how far through its backward (0..1) a byte's bucket became ready, the mean
    over bytes; the median backward (µs), the largest bucket (bytes) and the reduce rate
    achieved (bytes/µs = MB/s: the median over bucket collectives of bytes / their issue-to-
    completion time). None without buckets."""
    by_pid: dict = defaultdict(lambda: defaultdict(list))
    for e in events:
        kind = _kind(e)
        if kind:
            by_pid[e["pid"]][kind].append(e)
    steps, backward, rates, largest = [], [], [], 0
    for got in by_pid.values():
        bwd = sorted(got["backward"], key=lambda e: e["ts"])
        comm = sorted(got["comm"], key=lambda e: e["ts"])
        b_starts, c_starts = [e["ts"] for e in bwd], [e["ts"] for e in comm]
        per_step: dict[int, list[float]] = {}
        for b in got["bucket"]:
            i = bisect.bisect_right(b_starts, b["ts"]) - 1
            if i < 0:
                continue
            nbytes = b["args"]["bytes"]
            at = min(1.0, (b["ts"] - bwd[i]["ts"]) / bwd[i]["dur"]) if bwd[i]["dur"] > 0 else 1.0
            tot = per_step.setdefault(i, [0, 0.0])
            tot[0] += nbytes
            tot[1] += nbytes * at
            largest = max(largest, nbytes)
            c = _reduce_of(b, comm, c_starts)
            if c is not None and c["dur"] > 0:
                rates.append(nbytes / c["dur"])
        steps += per_step.values()
        backward += [bwd[i]["dur"] for i in per_step]
    total = sum(s[0] for s in steps)
    if not total:
        return None
    return {"bytes": statistics.median(s[0] for s in steps),
            "ready_at": sum(s[1] for s in steps) / total,
            "backward_us": statistics.median(backward), "largest": largest,
            "rate": statistics.median(rates) if rates else None}


def bucket_advice(events: list[dict]) -> str | None:
    """Why buckets fire late (`ready_at` >= LATE) and the bucket_mb to try, computed from the
    trace (or None).

    bucket_mb = TAIL x backward x the reduce rate achieved: a bucket that size reduces in
    a tenth of backward, so reductions start while backward runs and only the last one is
    left after it; kept between 1/16 and 1/4 of the gradients (per-call latency below,
    too few buckets above), and only advised when smaller than the largest bucket now.
    """
    t = bucket_timing(events)
    if t is None or t["ready_at"] < LATE or not t["rate"]:
        return None
    grads, rate, bwd = t["bytes"], t["rate"], t["backward_us"]
    raw = TAIL * bwd * rate
    size = min(grads / 4, max(grads / 16, raw))
    if size >= t["largest"]:
        return None
    how = f"{TAIL:g} x backward x the {rate:.0f} MB/s the bucket reductions achieved"
    if size == raw:
        how += ": each bucket reduces in about a tenth of backward while the next fills"
    else:
        how += (f" is {raw / 2**20:.2g} MiB; " + ("at least 1/16 of the gradients, so per-call "
                "latency stays small" if size > raw else "at most 1/4 of the gradients, so "
                "several buckets overlap backward"))
    return (f"buckets fire late: the {grads / 1e6:.2f} MB of gradients per step are ready for "
            f"reduction on average {100 * t['ready_at']:.0f}% of the way through backward "
            f"({bwd / 1e3:.1f} ms), so most of their reduction waits until it ends; try "
            f"bucket_mb={size / 2**20:.2g} ({how})")
