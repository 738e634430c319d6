"""Dense pushes vs top-k with error feedback: bytes pushed per step and time to a target loss.

    python benchmarks/ps_topk.py [--workers 2] [--ratios 0.1,0.01] [--target 0.25] [--epochs 8]

Runs examples/digits_ps.py through the launcher (`disttrain run --workers W --servers 1`,
Sync, server-side SGD with momentum) once dense and once per top-k ratio (`--topk R`).
Worker 0 logs the full training-set loss of the parameters it pulls against wall-clock
time. Prints, per run, the bytes worker 0 pushed per step (the transport's own counter:
MAC + msgpack header + buffers, without ZeroMQ's framing) and their ratio to dense, the
step and the time at which the loss first reached the target, the final loss and the
final test accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(topk: float | None, args, log: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DISTTRAIN_SERVERS")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "disttrain", "run", "--workers", str(args.workers),
           "--servers", "1", "examples/digits_ps.py", "--mode", "sync",
           "--epochs", str(args.epochs), "--log-json", log, "--eval-every", "2"]
    if topk is not None:
        cmd += ["--topk", str(topk)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    out = proc.stdout + proc.stderr
    points = [json.loads(line) for line in open(log)]
    hit = next((p for p in points if p["train_loss"] <= args.target), None)
    pushed = re.search(r"^worker 0: .* (\d+) bytes pushed per step", out, re.M)
    acc = re.findall(r"final test accuracy: ([0-9.]+)", out)
    return {"bytes": int(pushed.group(1)) if pushed else -1,
            "accuracy": float(acc[-1]) if acc else float("nan"),
            "steps_to_target": hit["step"] if hit else None,
            "time_to_target": hit["time"] if hit else None,
            "final_loss": points[-1]["train_loss"], "wall": points[-1]["time"],
            "steps": points[-1]["step"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ratios", default="0.1,0.01", help="top-k ratios, comma-separated")
    parser.add_argument("--target", type=float, default=0.25, help="training-set loss")
    parser.add_argument("--epochs", type=int, default=8)
    args = parser.parse_args()
    runs: dict[str, float | None] = {"dense": None}
    runs.update({f"top-k {r}": float(r) for r in args.ratios.split(",")})
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, ratio) in enumerate(runs.items()):
            results[name] = run(ratio, args, os.path.join(tmp, f"{i}.jsonl"))
            print(f"{name}: done in {results[name]['wall']:.1f}s", file=sys.stderr, flush=True)
    dense = results["dense"]["bytes"]
    print(f"digits MLP, Sync, {args.workers} workers + 1 server, {args.epochs} epochs, "
          f"target training loss {args.target}")
    print(f"| pushes | bytes pushed per step (worker 0) | vs dense | step at loss <= "
          f"{args.target} | time to it (s) | final loss | wall (s) | test accuracy |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        step = r["steps_to_target"] if r["steps_to_target"] is not None else "not reached"
        ttt = f"{r['time_to_target']:.2f}" if r["time_to_target"] is not None else "-"
        print(f"| {name} | {r['bytes']} | {r['bytes'] / dense:.3f} | {step} | {ttt} | "
              f"{r['final_loss']:.3f} | {r['wall']:.1f} | {r['accuracy']:.4f} |")


if __name__ == "__main__":
    main()
