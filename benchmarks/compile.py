"""Benchmark: torch.compile (inductor) against eager, for disttrain.DataParallel and torch DDP.

One spawned gloo job of `--world` ranks. Every rank holds four replicas of the same
model (a stack of pre-norm MLP blocks, a user module so Dynamo compiles its frames):
ours eager, ours `torch.compile`d, DDP eager, DDP `torch.compile`d (inductor by
default, DDP's graphs split at its buckets by torch's DDPOptimizer). After warm-up
(which is where compilation happens) they take turns, `--steps` timed steps each per
round, for `--rounds` rounds, the order rotating every round so that load drift hits all
alike. A step is zero_grad + forward + backward + SGD step; times are rank 0's wall
clock. Prints medians (ms), compiled/eager for each wrapper, ours/DDP for each mode,
and the median over rounds of the paired per-round ratios.

    python benchmarks/compile.py                       # world 2, the documented run
    python benchmarks/compile.py --backend aot_eager   # no C++ compiler needed
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


class Block(nn.Module):
    """x + W2 gelu(W1 layernorm(x)): elementwise work inductor can fuse."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):  # (B, W) -> (B, W)
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def make(width: int, depth: int) -> Stack:
    torch.manual_seed(0)
    return Stack(width, depth)


def timed_steps(model, opt, x, y, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return times


def bench_rank(width, depth, batch, steps, rounds, warmup, backend):
    """Runs on every rank; returns rank 0's step times per variant and compile times."""
    torch.manual_seed(1 + dist.get_rank())
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    wrapped = {"ours": disttrain.DataParallel(make(width, depth)),
               "ddp": nn.parallel.DistributedDataParallel(make(width, depth))}
    variants, opts, compile_s = {}, {}, {}
    for name, model in wrapped.items():
        again = disttrain.DataParallel(make(width, depth)) if name == "ours" else \
            nn.parallel.DistributedDataParallel(make(width, depth))
        variants[f"{name}_eager"] = model
        variants[f"{name}_compiled"] = torch.compile(again, backend=backend)
    for k, m in variants.items():
        opts[k] = torch.optim.SGD(m.parameters(), lr=1e-4)
        start = time.perf_counter()
        timed_steps(m, opts[k], x, y, 1)  # NOTE: the first step compiles
        compile_s[k] = time.perf_counter() - start
        timed_steps(m, opts[k], x, y, warmup)
    times: dict[str, list[list[float]]] = {k: [] for k in variants}  # [round][step]
    names = list(variants)
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            times[k].append(timed_steps(variants[k], opts[k], x, y, steps))
    n_params = sum(p.numel() for p in wrapped["ddp"].parameters())
    return {"times": times, "compile_s": compile_s, "params": n_params}


def _paired(times, a: str, b: str) -> float:
    return statistics.median(statistics.mean(x) / statistics.mean(y)
                             for x, y in zip(times[a], times[b]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64, help="per-rank batch")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--backend", default="inductor", help="torch.compile backend")
    args = ap.parse_args()
    out = spawn(bench_rank, args.world, args.width, args.depth, args.batch, args.steps,
                args.rounds, args.warmup, args.backend, timeout=1800,
                collective_timeout=600)[0]
    times = out["times"]
    med = {k: statistics.median(t for rnd in v for t in rnd) * 1e3 for k, v in times.items()}
    print(f"world {args.world}, {args.depth} blocks of width {args.width} "
          f"({out['params'] / 1e6:.2f} M params), per-rank batch {args.batch}, backend "
          f"{args.backend}, {args.rounds} rounds x {args.steps} steps; first step (compile) "
          + ", ".join(f"{k} {v:.1f} s" for k, v in out["compile_s"].items()))
    print("median step time (ms); ratios of the medians, (in brackets) median of per-round "
          "paired ratios")
    print("| wrapper | eager | compiled | compiled/eager |")
    print("|---|---|---|---|")
    for name, label in (("ours", "disttrain.DataParallel"), ("ddp", "torch DDP")):
        e, c = med[f"{name}_eager"], med[f"{name}_compiled"]
        print(f"| {label} | {e:.2f} | {c:.2f} | {c / e:.2f} "
              f"({_paired(times, f'{name}_compiled', f'{name}_eager'):.2f}) |")
    for mode in ("eager", "compiled"):
        print(f"ours/DDP {mode}: {med[f'ours_{mode}'] / med[f'ddp_{mode}']:.2f} "
              f"({_paired(times, f'ours_{mode}', f'ddp_{mode}'):.2f})")


if __name__ == "__main__":
    main()
