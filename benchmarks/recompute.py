"""Activation recomputation: bytes saved for backward, step time, and TP collectives.

Runs the GPT on 2 real processes as a 1F1B pipeline (pp=2) with and without
`parallelize(..., recompute=True)` (each transformer block under non-reentrant
torch.utils.checkpoint, Megatron's `--recompute-granularity full`) and prints, per stage:

- peak bytes saved for backward in a step (counted by saved_tensors_hooks in the
  pipeline runtime), and that divided by the micro-batches 1F1B holds at once on the
  stage (the per-micro-batch activation footprint);
- step wall time (median of the steps after a warm-up; recompute runs each block's
  forward twice, so expect about a third more compute).

Then it counts tensor-parallel allreduces (torch.profiler's `c10d::allreduce_`) of a
tp=2 GPT at two depths, with and without recompute: per transformer layer Megatron's
2 forward + 2 backward, plus 2 more in backward with recompute (g after attention and
after the MLP run again when a block is recomputed); benchmarks/tp_collectives.py
counts without recompute.

    python benchmarks/recompute.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from disttrain.mesh import Mesh
from disttrain.models import GPT, GPTConfig
from disttrain.parallel.parallelize import parallelize
from disttrain.parallel.pipeline import one_f_one_b, peak_in_flight
from disttrain.parallel.tensor import vocab_parallel_cross_entropy
from disttrain.testing import spawn


def pipeline_run(cfg: dict, batch: int, microbatches: int, steps: int):
    mesh = Mesh(pp=2)
    x = torch.randint(cfg["vocab_size"], (batch, cfg["block_size"]),
                      generator=torch.Generator().manual_seed(1))
    out = {}
    for recompute in (False, True):
        torch.manual_seed(0)
        pm = parallelize(GPT(GPTConfig(**cfg)), mesh, schedule="1f1b",
                         microbatches=microbatches, track_memory=True, recompute=recompute)
        opt = torch.optim.SGD(pm.parameters(), lr=0.01)
        times, losses = [], []
        for _ in range(steps + 1):
            opt.zero_grad()
            t = time.perf_counter()
            losses.append(pm.train_step(x, x).item())
            times.append(time.perf_counter() - t)
            opt.step()
        in_flight = peak_in_flight(one_f_one_b(2, microbatches)[mesh.local_rank("pp")])
        out[recompute] = (pm.pipeline.peak_activation_bytes, in_flight,
                          statistics.median(times[1:]), losses[-1])
    return out


def _count(fn):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    return sum(e.name == "c10d::allreduce_" for e in prof.events()), out


def tp_counts(depths=(1, 3)):
    mesh = Mesh(tp=2)
    group = mesh.group("tp")
    counts = {}
    for recompute in (False, True):
        for depth in depths:
            torch.manual_seed(0)
            model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=depth, n_head=4,
                                  n_embd=32))
            pm = parallelize(model, mesh, plan=GPT.tp_plan, recompute=recompute)
            x = torch.randint(64, (4, 16))
            fwd, loss = _count(lambda m=pm, x=x: vocab_parallel_cross_entropy(m(x), x, group))
            bwd, _ = _count(loss.backward)
            counts[(recompute, depth)] = (fwd, bwd)
    return counts


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args()
    cfg = dict(vocab_size=128, block_size=a.block_size, n_layer=a.n_layer, n_head=4,
               n_embd=a.n_embd)
    res = spawn(pipeline_run, 2, cfg, a.batch, a.microbatches, a.steps, timeout=600)
    print(f"GPT {cfg}, batch {a.batch}, 1F1B pp=2, {a.microbatches} micro-batches, "
          f"median of {a.steps} steps")
    print(f"{'stage':>5s} {'recompute':>9s} {'peak saved MiB':>14s} {'in flight':>9s} "
          f"{'MiB / micro-batch':>17s} {'step ms':>8s} {'loss':>7s}")
    for stage, r in enumerate(res):
        for recompute in (False, True):
            peak, n, t, loss = r[recompute]
            print(f"{stage:5d} {str(recompute):>9s} {peak / 2**20:14.2f} {n:9d} "
                  f"{peak / n / 2**20:17.3f} {t * 1e3:8.1f} {loss:7.4f}")
        ratio = r[False][0] / r[True][0]
        slow = r[True][2] / r[False][2]
        print(f"stage {stage}: saved bytes / {ratio:.1f} with recompute, step time x {slow:.2f}")
    counts = spawn(tp_counts, 2, timeout=300)[0]
    print("\nTP GPT on 2 ranks, allreduces (c10d::allreduce_) forward+loss / backward:")
    depths = sorted({d for _, d in counts})
    for recompute in (False, True):
        cells = "  ".join(f"L={d}: {counts[(recompute, d)][0]} / {counts[(recompute, d)][1]}"
                          for d in depths)
        lo, hi = depths[0], depths[-1]
        per_f = (counts[(recompute, hi)][0] - counts[(recompute, lo)][0]) / (hi - lo)
        per_b = (counts[(recompute, hi)][1] - counts[(recompute, lo)][1]) / (hi - lo)
        print(f"recompute={str(recompute):5s} {cells}   per layer: {per_f:g} forward, "
              f"{per_b:g} backward")


if __name__ == "__main__":
    main()
