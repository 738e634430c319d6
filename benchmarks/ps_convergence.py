"""Time to a target loss per consistency mode, under injected exponential stragglers.

    python benchmarks/ps_convergence.py [--workers 4] [--straggler exp:mean=0.05]
        [--target 0.25] [--epochs 8] [--plot docs/ps_convergence.png]

Runs examples/digits_ps.py through the launcher (`disttrain run --workers 4 --servers 1`)
once per mode: Sync, KSync(2), KBatchSync(2), Async, SSP(2), every run with the same
seeded straggler delays. Worker 0 logs the full training-set loss of the parameters it
pulls, against wall-clock time; the script prints, per mode, the time and number of
server updates to reach the target loss, the final loss and the final test accuracy, and
saves one loss-vs-time line per mode to a PNG.
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
MODES = {"Sync": ["--mode", "sync"], "KSync(2)": ["--mode", "ksync", "--k", "2"],
         "KBatchSync(2)": ["--mode", "kbatch-sync", "--k", "2"],
         "Async": ["--mode", "async"], "SSP(2)": ["--mode", "ssp", "--staleness", "2"]}


def run_mode(name: str, args, log: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DISTTRAIN_SERVERS")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "disttrain", "run", "--workers", str(args.workers),
           "--servers", "1", "examples/digits_ps.py", *MODES[name], "--epochs", str(args.epochs),
           "--straggler", args.straggler, "--log-json", log, "--eval-every", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    points = [json.loads(line) for line in open(log)]
    acc = re.findall(r"final test accuracy: ([0-9.]+)", proc.stdout)
    version = re.findall(r"version (\d+)", proc.stdout + proc.stderr)
    hit = next((p for p in points if p["train_loss"] <= args.target), None)
    return {"points": points, "accuracy": float(acc[-1]) if acc else float("nan"),
            "updates": int(version[-1]) if version else -1,
            "time_to_target": hit["time"] if hit else None,
            "final_loss": points[-1]["train_loss"], "wall": points[-1]["time"],
            "command": " ".join(cmd[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--straggler", default="exp:mean=0.05")
    parser.add_argument("--target", type=float, default=0.25, help="training-set loss")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--plot", default=str(ROOT / "docs" / "ps_convergence.png"))
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODES:
            results[name] = run_mode(name, args, os.path.join(tmp, f"{name}.jsonl"))
            r = results[name]
            print(f"{name}: done in {r['wall']:.1f}s", file=sys.stderr, flush=True)
    print(f"target training loss {args.target}, {args.workers} workers + 1 server, "
          f"straggler {args.straggler}, {args.epochs} epochs")
    print(f"| mode | time to loss <= {args.target} (s) | final loss | wall (s) | "
          "server updates | test accuracy |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        ttt = f"{r['time_to_target']:.2f}" if r["time_to_target"] is not None else "not reached"
        print(f"| {name} | {ttt} | {r['final_loss']:.3f} | {r['wall']:.1f} | {r['updates']} | "
              f"{r['accuracy']:.4f} |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in results.items():
        ax.plot([p["time"] for p in r["points"]], [p["train_loss"] for p in r["points"]],
                label=name)
    ax.axhline(args.target, color="grey", linestyle=":", label=f"target {args.target}")
    ax.set_xlabel("wall-clock time (s)")
    ax.set_ylabel("training loss (worker 0's view)")
    ax.set_yscale("log")
    ax.set_title(f"digits MLP, {args.workers} workers + 1 server, stragglers {args.straggler}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
    print(f"plot: {os.path.relpath(args.plot, ROOT)}")


if __name__ == "__main__":
    main()
