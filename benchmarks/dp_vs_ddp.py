"""Benchmark: disttrain.DataParallel against torch DDP on the same MLP, same processes.

Each world size is one spawned gloo job. Inside it every rank holds three replicas of
the same model (ours with fixed 25 MiB buckets, ours with bucket_mb="auto", torch
DistributedDataParallel with its defaults); after warm-up (which is also where "auto"
tunes) they take turns, `--steps` timed steps each per round, for `--rounds` rounds, the
order rotating every round so that drift in machine load hits all of them alike. A step
is zero_grad + forward + backward + SGD step; times are rank 0's wall clock per step.
Prints the median step time of each and the ratios ours/DDP: of the medians, and the
median over rounds of the paired per-round ratio (robust to load drift on a shared box).

    python benchmarks/dp_vs_ddp.py                # world 2 and 4, the documented run
    python benchmarks/dp_vs_ddp.py --worlds 4 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import disttrain
from disttrain.testing import spawn


def make_mlp(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def timed_steps(model, opt, x, y, steps: int, cpu: list[float] | None = None) -> list[float]:
    """Wall seconds per step; appends this process's CPU seconds (all threads) to `cpu`."""
    times = []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - start)
        if cpu is not None:
            cpu.append(time.process_time() - start_cpu)
    return times


def bench_rank(width, depth, batch, steps, rounds, warmup):
    """Runs on every rank; returns rank 0's step times per variant (blocks)."""
    torch.manual_seed(1 + dist.get_rank())
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    variants = {
        "ours_25mb": disttrain.DataParallel(make_mlp(width, depth), bucket_mb=25),
        "ours_auto": disttrain.DataParallel(make_mlp(width, depth), bucket_mb="auto"),
        "ddp": nn.parallel.DistributedDataParallel(make_mlp(width, depth)),
    }
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, m in variants.items()}
    for k, m in variants.items():
        timed_steps(m, opts[k], x, y, warmup)
    tuned = variants["ours_auto"]
    assert tuned.tuner.done, f"auto-tuning needs more than {warmup} warm-up steps"
    times: dict[str, list[list[float]]] = {k: [] for k in variants}  # [round][step]
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            times[k].append(timed_steps(variants[k], opts[k], x, y, steps, cpu[k]))
    n_params = sum(p.numel() for p in variants["ddp"].parameters())
    return {"times": times, "cpu": cpu, "params": n_params, "auto_mb": tuned.bucket_mb,
            "auto_candidates": tuned.tuner.candidate_times()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32, help="per-rank batch")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per variant per round")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=20, help="covers bucket_mb='auto' tuning")
    args = ap.parse_args()
    rows = []
    for world in args.worlds:
        out = spawn(bench_rank, world, args.width, args.depth, args.batch, args.steps,
                    args.rounds, args.warmup, timeout=1200, collective_timeout=300)[0]
        times = out["times"]
        med = {k: statistics.median(t for rnd in v for t in rnd) * 1e3 for k, v in times.items()}
        # Paired: each round's mean against DDP's in the same round (load drift cancels).
        paired = {k: statistics.median(statistics.mean(a) / statistics.mean(b)
                                       for a, b in zip(times[k], times["ddp"]))
                  for k in ("ours_25mb", "ours_auto")}
        cpu = {k: statistics.median(v) * 1e3 for k, v in out["cpu"].items()}
        rows.append((world, out["params"], med, out["auto_mb"], paired, cpu))
        print(f"world {world}: auto-tuning medians (ms) per candidate: "
              f"{[round(t * 1e3, 1) for t in out['auto_candidates']]}", flush=True)
    print(f"\nMLP {args.depth}x{args.width}, {rows[0][1] / 1e6:.2f} M params, per-rank batch "
          f"{args.batch}, {args.rounds} rounds x {args.steps} steps, median step time (ms)")
    print("ratios: of the medians, and (in brackets) the median of per-round paired ratios")
    print("| world | ours 25 MiB | ours auto (chosen) | torch DDP | ours/DDP | auto/DDP |")
    print("|---|---|---|---|---|---|")
    for world, _, med, auto_mb, paired, _ in rows:
        print(f"| {world} | {med['ours_25mb']:.1f} | {med['ours_auto']:.1f} ({auto_mb:.3g} MiB) "
              f"| {med['ddp']:.1f} | {med['ours_25mb'] / med['ddp']:.2f} "
              f"({paired['ours_25mb']:.2f}) | {med['ours_auto'] / med['ddp']:.2f} "
              f"({paired['ours_auto']:.2f}) |")
    print("\nCPU time per step on rank 0 (ms, all threads; less sensitive to a busy machine)")
    print("| world | ours 25 MiB | ours auto | torch DDP | ours/DDP |")
    print("|---|---|---|---|---|")
    for world, _, _, _, _, cpu in rows:
        print(f"| {world} | {cpu['ours_25mb']:.1f} | {cpu['ours_auto']:.1f} | {cpu['ddp']:.1f} "
              f"| {cpu['ours_25mb'] / cpu['ddp']:.2f} |")


if __name__ == "__main__":
    main()
