"""Benchmark: what `disttrain.preempted()` costs per training step (no signal came).

One spawned gloo job of `--world` ranks, a small MLP under DataParallel. Prints rank 0's
medians over `--rounds` rounds of `--steps` steps:
- a DataParallel step (forward, backward, all-reduce) with the flag riding its last
  bucket, and the same step with the flag switched off (alternating rounds);
- the `preempted()` call after such a step (reads the flag the bucket brought back);
- the `preempted()` call with no world-wide reduction since the last call (the fallback:
  one all-reduce of one element).

    python benchmarks/preempt_cost.py              # world 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import disttrain
from disttrain.testing import spawn


def _steps(model, steps: int, poll: bool) -> tuple[float, float]:
    """(us per step, us per preempted() call) over `steps` steps."""
    x = torch.randn(32, 64)
    polled = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        model(x).sum().backward()
        if poll:
            t = time.perf_counter()
            disttrain.preempted()
            polled += time.perf_counter() - t
    total = time.perf_counter() - start
    return (total - polled) / steps * 1e6, polled / steps * 1e6


def bench(steps: int, rounds: int) -> dict:
    torch.manual_seed(0)
    model = disttrain.DataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)))
    sync = model._sync
    flag = (sync._flag_bucket, sync._flag_wire, sync._flag)
    disttrain.preempted()
    _steps(model, 10 * steps, True)  # NOTE: the first hundreds of steps are much slower
    out = {"step, flag on": [], "step, flag off": [], "preempted(), after a step": [],
           "preempted(), fallback all-reduce": []}
    for r in range(rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            sync._flag_bucket, sync._flag_wire, sync._flag = flag if on else (-1, None, None)
            step_us, poll_us = _steps(model, steps, on)
            out["step, flag on" if on else "step, flag off"].append(step_us)
            if on:
                out["preempted(), after a step"].append(poll_us)
        t = time.perf_counter()
        for _ in range(steps):
            disttrain.preempted()
        out["preempted(), fallback all-reduce"].append((time.perf_counter() - t) / steps * 1e6)
    sync._flag_bucket, sync._flag_wire, sync._flag = flag
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    res = spawn(bench, args.world, args.steps, args.rounds, timeout=900)[0]
    print(f"world {args.world}, MLP 64-256-64, batch 32, {args.steps} steps x {args.rounds} rounds (rank 0, medians)")
    for name, us in res.items():
        print(f"{name:36s} {us:9.1f} us")
    print(f"flag on - off: {res['step, flag on'] - res['step, flag off']:+.1f} us per step")


if __name__ == "__main__":
    main()
