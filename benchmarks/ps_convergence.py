"""Time to a target loss per consistency mode, under injected exponential stragglers.

    python benchmarks/ps_convergence.py [--workers 4] [--straggler exp:mean=0.05]
        [--target 0.25] [--epochs 8] [--plot docs/ps_convergence.png] [--reps 3] [--simulate]

Runs examples/digits_ps.py through the launcher (`disttrain run --workers 4 --servers 1`)
once per mode: Sync, KSync(2), KBatchSync(2), Async, SSP(2), every run with the same
seeded straggler delays. Worker 0 logs the full training-set loss of the parameters it
pulls, against wall-clock time; the script prints, per mode, the time and number of
server updates to reach the target loss, the final loss and the final test accuracy, and
saves one loss-vs-time line per mode to a PNG.

With --reps N the modes run N times, interleaved (mode by mode within each repetition),
and a summary prints each mode's median time to the target with its spread (max - min).
With --simulate each repetition also runs one worker without stragglers (its steady
seconds per update is a step's own cost alone: compute, the wire, the server) and the
parameter-server simulator (disttrain.plan.ps) gives each mode's time per update with
that base, shared on this machine's cores beside the other runnable processes (the load
average), plus the stragglers; time per update x the median updates the mode needed is
its predicted time to the target, printed beside the measured one, with Kendall's tau
over the pairs of modes whose medians differ by more than the larger of their spreads.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
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
    # NOTE: the server's report ("version 360, applied 360"), not the manager's ring version
    version = re.findall(r"version (\d+), applied", proc.stdout + proc.stderr)
    hit = next((p for p in points if p["train_loss"] <= args.target), None)
    return {"points": points, "accuracy": float(acc[-1]) if acc else float("nan"),
            "updates": int(version[-1]) if version else -1,
            "time_to_target": hit["time"] if hit else None,
            "updates_to_target": hit.get("version") if hit else None,
            "final_loss": points[-1]["train_loss"], "wall": points[-1]["time"],
            "load": os.getloadavg()[0], "command": " ".join(cmd[1:])}


def steady_seconds_per_update(points: list[dict], trim: float = 0.2) -> float:
    """Least-squares slope of worker 0's log time against the server version it pulled,
    over the points between the first and the last fifth (start-up and the end left out)."""
    pts = [(p["version"], p["time"]) for p in points if "version" in p]
    cut = int(len(pts) * trim)
    pts = pts[cut:len(pts) - cut] if len(pts) - 2 * cut >= 4 else pts
    if len(pts) < 3 or pts[-1][0] == pts[0][0]:
        raise RuntimeError(f"too few log points to measure a rate: {pts}")
    mv = statistics.fmean(v for v, _ in pts)
    mt = statistics.fmean(t for _, t in pts)
    return sum((v - mv) * (t - mt) for v, t in pts) / sum((v - mv) ** 2 for v, _ in pts)


def sleep_overrun_seconds(waits: int = 50, seconds: float = 0.02) -> float:
    """Mean seconds a `threading.Event.wait(seconds)` lasts longer than asked (blocks ~1 s)."""
    event, over = threading.Event(), []
    for _ in range(waits):
        t0 = time.monotonic()
        event.wait(seconds)
        over.append(time.monotonic() - t0 - seconds)
    return statistics.fmean(over)


def resolved_tau(measured: dict[str, list[float]], predicted: dict[str, float]):
    """Kendall's tau of `predicted` against the measured medians over the pairs whose
    medians differ by more than the larger of the two spreads (max - min); returns
    (tau or None, concordant, discordant, the pairs left out)."""
    med = {n: statistics.median(v) for n, v in measured.items()}
    spread = {n: max(v) - min(v) for n, v in measured.items()}
    good = bad = 0
    left = []
    for a, b in itertools.combinations(measured, 2):
        if abs(med[a] - med[b]) <= max(spread[a], spread[b]):
            left.append(f"{a}/{b}")
            continue
        same = (med[a] - med[b]) * (predicted[a] - predicted[b]) > 0
        good, bad = good + same, bad + (not same)
    return ((good - bad) / (good + bad) if good + bad else None), good, bad, left


def summary(results: dict[str, list[dict]], steady: list[dict], args) -> None:
    """Medians and spreads per mode; with --simulate the prediction and the orders."""
    times = {n: [r["time_to_target"] for r in rs if r["time_to_target"] is not None]
             for n, rs in results.items()}
    times = {n: t for n, t in times.items() if t}
    need = {n: int(statistics.median(r["updates_to_target"] for r in results[n])) for n in times}
    predicted = {}
    if steady:
        from disttrain.plan.ps import parse_mode
        from disttrain.plan.simulate import Compute, simulate
        from disttrain.ps.straggler import parse_straggler

        base = statistics.median(steady_seconds_per_update(r["points"]) for r in steady)
        background = max(statistics.median(r["load"] for r in steady) - 1, 0.0)
        cores, wake = os.cpu_count() or 1, sleep_overrun_seconds()
        print(f"\nsimulated (disttrain.plan.ps, {args.workers} workers, base {base * 1e3:.2f} ms "
              f"(1 worker without stragglers, steady, median of {len(steady)}) + {args.straggler}; "
              f"shared: on {cores} cores beside {background:.1f} other runnable processes, every "
              f"sleep {wake * 1e3:.2f} ms longer (a 20 ms wait's mean overrun here)")
        for cores_ in (None, cores):
            compute = Compute(parse_straggler(args.straggler), base, cores_, background,
                              wake if cores_ else 0.0)
            for n in times:
                mode = parse_mode(PLAN[n])
                r = simulate(lambda m=mode: m.build(args.workers), args.workers, compute)
                predicted[(n, cores_)] = r.time_per_update
    print(f"\n| mode | time to target, median of {args.reps} (s) | spread (s) | updates to it "
          "(median) | measured s per update | predicted s per update, own core / shared "
          "| predicted time (s), own core / shared |")
    print("|---|---|---|---|---|---|---|")
    for n, t in times.items():
        med = statistics.median(t)
        row = f"| {n} | {med:.2f} | {max(t) - min(t):.2f} | {need[n]} | {med / need[n]:.4f} |"
        if predicted:
            own, shared = predicted[(n, None)], predicted[(n, os.cpu_count() or 1)]
            row += f" {own:.4f} / {shared:.4f} | {own * need[n]:.2f} / {shared * need[n]:.2f} |"
        print(row)
    order = sorted(times, key=lambda n: statistics.median(times[n]))
    print(f"measured order (medians): {', '.join(order)}")
    for label, key in (("own core", None), ("shared cores", os.cpu_count() or 1)):
        if not predicted:
            break
        pred = {n: predicted[(n, key)] * need[n] for n in times}
        tau, good, bad, left = resolved_tau(times, pred)
        print(f"predicted order ({label}): {', '.join(sorted(times, key=pred.get))}; Kendall tau "
              f"over the {good + bad} pairs apart by more than their spread: "
              f"{'n/a' if tau is None else f'{tau:.2f}'} ({good} concordant, {bad} discordant); "
              f"within the spread: {', '.join(left) or 'none'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--straggler", default="exp:mean=0.05")
    parser.add_argument("--target", type=float, default=0.25, help="training-set loss")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--plot", default=str(ROOT / "docs" / "ps_convergence.png"))
    parser.add_argument("--simulate", action="store_true",
                        help="also predict each mode's time to target with disttrain.plan.ps")
    parser.add_argument("--reps", type=int, default=1, help="repetitions, interleaved")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}", flush=True)
    results: dict[str, list[dict]] = {name: [] for name in MODES}
    steady: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for name in MODES:
                results[name].append(run_mode(name, args, os.path.join(tmp, f"{name}{rep}.jsonl")))
                r = results[name][-1]
                print(f"rep {rep} {name}: done in {r['wall']:.1f}s, time to target "
                      f"{r['time_to_target']}, load {r['load']:.1f}", file=sys.stderr, flush=True)
            if args.simulate:
                steady.append(run_mode("Sync", args, os.path.join(tmp, f"steady{rep}.jsonl"),
                                       "none", 1))
    print(f"target training loss {args.target}, {args.workers} workers + 1 server, "
          f"straggler {args.straggler}, {args.epochs} epochs; load average at end: "
          f"{os.getloadavg()}")
    print(f"| mode | rep | time to loss <= {args.target} (s) | updates to it | final loss | "
          "wall (s) | server updates | test accuracy |")
    print("|---|---|---|---|---|---|---|---|")
    for name, rs in results.items():
        for rep, r in enumerate(rs):
            ttt = f"{r['time_to_target']:.2f}" if r["time_to_target"] is not None else "not reached"
            print(f"| {name} | {rep} | {ttt} | {r['updates_to_target']} | {r['final_loss']:.3f} | "
                  f"{r['wall']:.1f} | {r['updates']} | {r['accuracy']:.4f} |")
    if args.reps > 1 or args.simulate:
        summary(results, steady, args)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, rs in results.items():
        r = rs[0]
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
