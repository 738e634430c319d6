"""Time to a target loss per consistency mode, under injected exponential stragglers.

    python benchmarks/ps_convergence.py [--workers 4] [--straggler exp:mean=0.05]
        [--target 0.25] [--epochs 8] [--plot docs/ps_convergence.png]

Runs examples/digits_ps.py through the launcher (`disttrain run --workers 4 --servers 1`)
once per mode: Sync, KSync(2), KBatchSync(2), Async, SSP(2), every run with the same
seeded straggler delays. Worker 0 logs the full training-set loss of the parameters it
pulls, against wall-clock time; the script prints, per mode, the time and number of
server updates to reach the target loss, the final loss and the final test accuracy, and
saves one loss-vs-time line per mode to a PNG.

With --simulate it also runs one worker without stragglers (its wall time per update is
a step's own cost alone: compute, the wire, the server) and asks the parameter-server
simulator (disttrain.plan.ps) for each mode's time per update with that base plus the
stragglers; time per update x the updates the mode needed is its predicted time to the
target, printed beside the measured one with both orders.
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
PLAN = {"Sync": "sync", "KSync(2)": "ksync:2", "KBatchSync(2)": "kbatch-sync:2",
        "Async": "async", "SSP(2)": "ssp:2"}  # the same modes as disttrain.plan.ps names them
MODES = {"Sync": ["--mode", "sync"], "KSync(2)": ["--mode", "ksync", "--k", "2"],
         "KBatchSync(2)": ["--mode", "kbatch-sync", "--k", "2"],
         "Async": ["--mode", "async"], "SSP(2)": ["--mode", "ssp", "--staleness", "2"]}


def run_mode(name: str, args, log: str, straggler: str | None = None,
             workers: int | None = None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DISTTRAIN_SERVERS")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "disttrain", "run", "--workers", str(workers or args.workers),
           "--servers", "1", "examples/digits_ps.py", *MODES[name], "--epochs", str(args.epochs),
           "--straggler", straggler or args.straggler, "--log-json", log, "--eval-every", "2"]
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
            "updates_to_target": hit.get("version") if hit else None,
            "final_loss": points[-1]["train_loss"], "wall": points[-1]["time"],
            "command": " ".join(cmd[1:])}


def simulated(results: dict, steady: dict, args) -> None:
    """Print the simulator's time to target per mode beside the measured one."""
    from disttrain.plan.ps import parse_mode, recommend
    from disttrain.plan.simulate import Compute
    from disttrain.ps.straggler import parse_straggler

    base = steady["wall"] / steady["updates"]
    needs = {parse_mode(PLAN[n]): r["updates_to_target"] for n, r in results.items()
             if r["updates_to_target"]}
    compute = Compute(parse_straggler(args.straggler), base)
    ranked, sentence = recommend(needs, args.workers, compute)
    names = {parse_mode(v): k for k, v in PLAN.items()}
    print(f"\nsimulated (disttrain.plan.ps, {args.workers} workers, compute {base * 1e3:.2f} ms "
          f"+ {args.straggler}; base = 1 worker without stragglers: {steady['wall']:.2f} s / "
          f"{steady['updates']} updates)")
    print("| mode | simulated s per update | measured (time / updates to target) | "
          "x updates to target | predicted time (s) | measured time (s) |")
    print("|---|---|---|---|---|---|")
    for c in ranked:
        name = names[c.mode]
        measured = results[name]["time_to_target"]
        print(f"| {name} | {c.result.time_per_update:.4f} | "
              f"{measured / c.updates_to_target:.4f} | {c.updates_to_target} | "
              f"{c.seconds:.2f} | {measured:.2f} |")
    measured = sorted(needs, key=lambda m: results[names[m]]["time_to_target"])
    print(f"predicted order: {', '.join(names[c.mode] for c in ranked)}")
    print(f"measured order:  {', '.join(names[m] for m in measured)}")
    print(sentence)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--straggler", default="exp:mean=0.05")
    parser.add_argument("--target", type=float, default=0.25, help="training-set loss")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--plot", default=str(ROOT / "docs" / "ps_convergence.png"))
    parser.add_argument("--simulate", action="store_true",
                        help="also predict each mode's time to target with disttrain.plan.ps")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODES:
            results[name] = run_mode(name, args, os.path.join(tmp, f"{name}.jsonl"))
            r = results[name]
            print(f"{name}: done in {r['wall']:.1f}s", file=sys.stderr, flush=True)
        if args.simulate:
            steady = run_mode("Sync", args, os.path.join(tmp, "steady.jsonl"), "none", 1)
    print(f"target training loss {args.target}, {args.workers} workers + 1 server, "
          f"straggler {args.straggler}, {args.epochs} epochs")
    print(f"| mode | time to loss <= {args.target} (s) | updates to it | final loss | wall (s) | "
          "server updates | test accuracy |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        ttt = f"{r['time_to_target']:.2f}" if r["time_to_target"] is not None else "not reached"
        print(f"| {name} | {ttt} | {r['updates_to_target']} | {r['final_loss']:.3f} | "
              f"{r['wall']:.1f} | {r['updates']} | {r['accuracy']:.4f} |")
    if args.simulate:
        simulated(results, steady, args)
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
