"""Time per training step of examples/digits_ps.py at replicas = 1, 2, 3.

    python benchmarks/ps_replicas_digits.py [--modes sync,async] [--reps 3] [--epochs 4]

Runs `disttrain run --workers 2 --servers 3 examples/digits_ps.py --mode M --replicas R`
through the launcher, every (mode, r) once per repetition, the order rotated between
repetitions (interleaved, so a change of the machine's load falls on every r alike).
Worker 0's --log-json points give its wall time per step between the first and the last
logged step (a step: pull, forward, backward, push; under Sync one step is one server
update); the script prints, per mode and r, the median over repetitions, the ratio to
r = 1, the final test accuracy and the load average seen at the start of each run.
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


def run(mode: str, r: int, epochs: int, log: str) -> dict:
    """One job; blocks until it ends; raises with its output if it failed."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DISTTRAIN_SERVERS")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "disttrain", "run", "--workers", "2", "--servers", "3",
           "examples/digits_ps.py", "--mode", mode, "--replicas", str(r), "--epochs",
           str(epochs), "--log-json", log, "--eval-every", "10"]
    load = os.getloadavg()[0]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    points = [json.loads(line) for line in open(log)]
    first, last = points[0], points[-1]
    acc = re.findall(r"final test accuracy: ([0-9.]+)", proc.stdout)
    return {"step_s": (last["time"] - first["time"]) / (last["step"] - first["step"]),
            "accuracy": float(acc[-1]) if acc else float("nan"), "load": load,
            "command": " ".join(["disttrain", *cmd[3:]])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="sync,async")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=4)
    args = ap.parse_args()
    jobs = [(m, r) for m in args.modes.split(",") for r in (1, 2, 3)]
    got: dict[tuple, list[dict]] = {j: [] for j in jobs}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            order = jobs[rep % len(jobs):] + jobs[:rep % len(jobs)]  # NOTE: rotated
            for mode, r in order:
                log = os.path.join(tmp, f"{mode}{r}-{rep}.jsonl")
                res = run(mode, r, args.epochs, log)
                got[(mode, r)].append(res)
                print(f"rep {rep} {mode} r={r}: {res['step_s'] * 1e3:.1f} ms/step, accuracy "
                      f"{res['accuracy']:.4f}, load {res['load']:.1f}", flush=True)
    print("\n| mode | r | ms per step (median) | / r = 1 | final accuracy | runs |")
    print("|---|---|---|---|---|---|")
    for mode, r in jobs:
        med = statistics.median(x["step_s"] for x in got[(mode, r)])
        base = statistics.median(x["step_s"] for x in got[(mode, 1)])
        accs = ", ".join(f"{x['accuracy']:.4f}" for x in got[(mode, r)])
        print(f"| {mode} | {r} | {med * 1e3:.1f} | {med / base:.2f} | {accs} | "
              f"{len(got[(mode, r)])} |")
    loads = [x["load"] for v in got.values() for x in v]
    print(f"\nload average (1 min) at the start of the runs: {min(loads):.1f} to {max(loads):.1f}")
    print("command:", got[jobs[0]][0]["command"])


if __name__ == "__main__":
    main()
