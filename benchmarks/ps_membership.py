"""A server drained (or added) while the workers train: keys and bytes moved, the pause, step times.

    python benchmarks/ps_membership.py [--servers 3] [--drain 1] [--at 30] [--epochs 8] [--reps 1]
        [--replicas 1]
    python benchmarks/ps_membership.py --join [--servers 2] [--at 30] [--epochs 8] [--reps 1]

Runs `disttrain run --workers 2 --servers S examples/digits_ps.py` (Sync, --replicas R)
without a change and with `--drain-server-at AT --drain-server I` (worker 0 drains
server I right after sending its push of step AT: ps/move.py with R = 1, ps/handover.py
with R >= 2, where nothing moves: the keys column counts the keys its copies take over
and MB and cut are 0), `--reps` times each, interleaved. Prints per run: the keys and bytes the drained server handed over (values
and momentum), its cut's pause, how long the moved keys paused (worker 0's longest step from AT on:
the one whose pull waited for their new servers), the pause per moved key, worker 0's
median step time before AT, during (from AT to that step) and after it, and whether the final parameters' sha256 equals the run without
the change. With --join the change is `--add-server-at AT` instead (worker 0 starts the
script as a server that joins: ps/join_moves.py); keys, bytes and cut are summed over the
old owners that handed keys to it (with --replicas >= 2 the tails copied them before the
hand-over, a marker between two updates: cut 0, MB the values alone). Wall times are the loaded machine's; quote ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HANDED = re.compile(r"\[ps server\d+\] handed (\d+) keys \(([\d.]+) MB with optimizer state\) "
                    r"over at version (\d+); cut paused it ([\d.]+) ms")
HANDS = re.compile(r"\[ps server\d+\] leaving \(ring version \d+\): its (\d+) keys go to their "
                   r"next live copies")
GIVEN = re.compile(r"\[ps server\d+\] handed (\d+) keys \(([\d.]+) MB with optimizer state\) "
                   r"to joining server \d+ at version (\d+); cut paused it ([\d.]+) ms")

GIVEN_COPIES = re.compile(r"\[ps server\d+\] handed (\d+) keys \(([\d.]+) MB\) over at version "
                          r"(\d+) \(ring version \d+\); it keeps \d+")
"""replicas >= 2 (ps/join_head.py): the tails copied the keys before; the old owner only
sends a marker between two updates, so there is no cut to time (MB: the values)."""


def run(servers: int, epochs: int, drain: int | None, at: int, times: str,
        replicas: int = 1, join: bool = False) -> dict:
    """One job; blocks until it ends; raises with its output if it failed."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DISTTRAIN_SERVERS")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "disttrain", "run", "--workers", "2", "--servers", str(servers),
           "examples/digits_ps.py", "--epochs", str(epochs), "--step-times", times,
           "--replicas", str(replicas)]
    if drain is not None:
        cmd += (["--add-server-at", str(at)] if join else
                ["--drain-server-at", str(at), "--drain-server", str(drain)])
    load = os.getloadavg()[0]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out[-4000:]}")
    with open(times) as f:
        t = [json.loads(line)["time"] for line in f]
    steps = [b - a for a, b in zip([0.0, *t], t)]  # (steps,) seconds each
    # NOTE: the keys pause in the step whose pull waits for their new servers: the longest
    # from AT on; "during" is AT to that step, "after" what follows it
    # NOTE: with --join, step AT holds worker 0's wait for the joiner's process (ps.joined):
    # reported as "start", the search for the keys' pause begins after it
    first = at if join and drain is not None else at - 1
    p = max(range(first, len(steps)), key=steps.__getitem__)
    res = {"load": load, "sha": re.search(r"final parameters sha256 (\w+)", out).group(1),
           "before": statistics.median(steps[5:at - 1]), "pause_step": p + 1,
           "start": steps[at - 1], "during": statistics.median(steps[first:p + 1]),
           "after": statistics.median(steps[p + 1:]), "pause": steps[p]}
    if drain is not None and join:
        given = GIVEN.findall(out) or [(*g, "0") for g in GIVEN_COPIES.findall(out)]
        if not given:
            raise RuntimeError(f"no hand-over in the output:\n{out[-4000:]}")
        res.update(keys=sum(int(g[0]) for g in given), mb=sum(float(g[1]) for g in given),
                   cut_ms=max(float(g[3]) for g in given))
        return res
    m, h = HANDED.search(out), HANDS.search(out)
    if drain is not None:
        if m is None and h is None:
            raise RuntimeError(f"no hand-over in the output:\n{out[-4000:]}")
        if m is not None:
            res.update(keys=int(m.group(1)), mb=float(m.group(2)), cut_ms=float(m.group(4)))
        else:  # NOTE: replicas >= 2: nothing moves, its copies take the keys over
            res.update(keys=int(h.group(1)), mb=0.0, cut_ms=0.0)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", type=int, default=3)
    ap.add_argument("--drain", type=int, default=1, help="the server to drain")
    ap.add_argument("--at", type=int, default=30, help="worker 0's step of the drain")
    ap.add_argument("--epochs", type=int, default=8,
                    help="enough steps after AT for the drain (heartbeats 1 s apart) to finish")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--join", action="store_true",
                    help="add a server at AT (--add-server-at) instead of draining one")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for drain in (None, args.drain):
                path = os.path.join(tmp, f"times-{rep}-{drain}.jsonl")
                rows.append((drain, run(args.servers, args.epochs, drain, args.at, path,
                                        args.replicas, args.join)))
    plain = {r["sha"] for d, r in rows if d is None}
    what = f"server {args.servers} joins" if args.join else f"drain server {args.drain}"
    print(f"servers {args.servers}, 2 workers, Sync, replicas {args.replicas}, {what} at step "
          f"{args.at}, {args.epochs} epochs")
    print("run      load  keys    MB  cut ms  pause s  per key ms  step ms before/during/after"
          "  (x before)  pause at step  sha256 = run without")
    for drain, r in rows:
        name = "plain" if drain is None else "join" if args.join else f"drain {drain}"
        moved = (f"{r['keys']:>5} {r['mb']:>5.2f} {r['cut_ms']:>7.1f} {r['pause']:>8.2f} "
                 f"{r['pause'] / r['keys'] * 1e3:>11.2f}" if drain is not None else " " * 40)
        print(f"{name:<8} {r['load']:>4.1f} {moved}  {r['before'] * 1e3:>6.1f} / "
              f"{r['during'] * 1e3:>6.1f} / {r['after'] * 1e3:>6.1f}  ({r['during'] / r['before']:.2f}"
              f" / {r['after'] / r['before']:.2f})  {r['pause_step']:>4}  {r['sha'][:12]} "
              f"{r['sha'] in plain}" + (f"  (step {args.at}: {r['start']:.2f} s, the joiner's "
                                       "start)" if args.join and drain is not None else ""))


if __name__ == "__main__":
    sys.exit(main())
