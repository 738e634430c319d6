"""Benchmark: step time, memory and bytes sent of DataParallel and ZeRO stages 0-3.

Two parts, both on an MLP with AdamW at world 4 (gloo, CPU):

1. memory: one fresh spawned job per variant (so each process's peak RSS is its own).
   After `--mem-steps` steps, rank 0 reports its measured model-state bytes
   (`disttrain.memory.model_state`), the paper's prediction (`disttrain.plan`, fp32
   variant), its peak RSS during those steps (Linux VmHWM, reset after construction and
   a first step) minus its RSS before the model was built (model states + activations +
   transient buffers + allocator slack),
   ZeRO's own high-water mark of gathered parameters + in-flight gradients (stage 3),
   and the bytes it sent per step (ring-algorithm count, `Zero.comm_stats`).
2. time: one job holding every variant; after warm-up they take turns, `--steps` timed
   steps each per round, the order rotating each round; median of rank 0's step times.

Peers from torch in the same jobs: `torch_zero1` = DistributedDataParallel +
ZeroRedundancyOptimizer (torch's ZeRO-1: gradients all-reduced, parameters broadcast by
their owners) and `torch_fsdp` = FSDP2 `fully_shard` on every Linear and the root
(torch's ZeRO-3).

    python benchmarks/zero_stages.py                       # the documented run
    python benchmarks/zero_stages.py --parts time --rounds 12
    python benchmarks/zero_stages.py --world 2 --width 512 --rounds 3
    python benchmarks/zero_stages.py --precision bf16      # mixed precision: stages 0-3

`--precision bf16|fp16` runs `disttrain.Zero(..., precision=...)` at stages 0 (= DP,
the baseline) to 3 (DataParallel and the torch peers have no fp32-master mode here) and
compares with the paper's mixed-precision formulas (2 + 2 + 12) Psi etc.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
from dp_vs_ddp import make_mlp  # same MLP as the DP benchmark (benchmarks/ is sys.path[0])
from torch import nn

import disttrain
from disttrain import memory, plan
from disttrain.testing import spawn

VARIANTS = ("dp", "zero0", "zero1", "zero2", "zero3", "torch_zero1", "torch_fsdp")
MIXED_VARIANTS = ("zero0", "zero1", "zero2", "zero3")


def variants(precision: str) -> tuple[str, ...]:
    return VARIANTS if precision == "fp32" else MIXED_VARIANTS


def build(variant: str, width: int, depth: int, bucket_mb: float, precision: str = "fp32"):
    """(model, optimizer) for one variant (blocks: broadcasts parameters)."""
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-4)  # noqa: E731
    if variant == "dp":
        model = disttrain.DataParallel(make_mlp(width, depth), bucket_mb=bucket_mb)
        return model, adamw(list(model.parameters()))
    if variant == "torch_zero1":  # torch's ZeRO-1: DDP + ZeroRedundancyOptimizer
        from torch.distributed.optim import ZeroRedundancyOptimizer

        model = nn.parallel.DistributedDataParallel(make_mlp(width, depth),
                                                    bucket_cap_mb=bucket_mb)
        return model, ZeroRedundancyOptimizer(model.parameters(),
                                              optimizer_class=torch.optim.AdamW, lr=1e-4)
    if variant == "torch_fsdp":  # torch's ZeRO-3: FSDP2, one unit per Linear, as ours
        from torch.distributed.fsdp import fully_shard

        model = make_mlp(width, depth)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        return model, adamw(list(model.parameters()))
    model = disttrain.Zero(make_mlp(width, depth), adamw, stage=int(variant[-1]),
                           bucket_mb=bucket_mb, precision=precision)
    return model, model.optimizer


def step(model, opt, x, y) -> float:
    start = time.perf_counter()
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x).float(), y)  # fp32 loss (a no-op cast in fp32)
    opt.backward(loss) if hasattr(opt, "backward") else loss.backward()  # fp16: scaled
    opt.step()
    return time.perf_counter() - start


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_now() -> int:
    kib = _status_kib("VmRSS")
    return (kib if kib is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM, the peak RSS (no-op elsewhere)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss() -> int:
    kib = _status_kib("VmHWM")
    return (kib if kib is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def memory_rank(variant, width, depth, batch, steps, bucket_mb, precision="fp32"):
    """One variant on every rank; rank 0's numbers come back (blocks)."""
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    step(nn.Linear(width, width), torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1), x, y)
    before = rss_now()
    model, opt = build(variant, width, depth, bucket_mb, precision)
    step(model, opt, x, y)  # NOTE: optimizer state appears at the first step
    reset_peak_rss()  # the peak below is over training steps, not construction
    for _ in range(steps):
        if variant.startswith("zero"):
            model.comm_stats.reset()
        step(model, opt, x, y)
    if variant.startswith("zero"):
        ms = memory.model_state(model)
    else:  # ZeroRedundancyOptimizer keeps this rank's optimizer in .optim
        ms = memory.model_state(model, getattr(opt, "optim", opt))
    engine = getattr(model, "engine", None)
    return {"params": ms.params, "grads": ms.grads, "optimizer": ms.optimizer,
            "rss_growth": peak_rss() - before, "engine_peak": getattr(engine, "peak", None),
            "sent": model.comm_stats.total() if variant.startswith("zero") else None}


def time_rank(width, depth, batch, steps, rounds, warmup, bucket_mb, precision="fp32"):
    """Every variant on every rank, interleaved; rank 0's step times (blocks)."""
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    names = variants(precision)
    built = {v: build(v, width, depth, bucket_mb, precision) for v in names}
    for m, o in built.values():
        for _ in range(warmup):
            step(m, o, x, y)
    times: dict[str, list[float]] = {v: [] for v in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for v in order:
            dist.barrier()
            times[v] += [step(*built[v], x, y) for _ in range(steps)]
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32, help="per-rank batch")
    ap.add_argument("--mem-steps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--bucket-mb", type=float, default=4.0,
                    help="gradient bucket MiB for DP and stages 0-2 (4 = one 1024x1024 layer)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--parts", nargs="+", choices=("memory", "time"), default=["memory", "time"])
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"),
                    help="bf16/fp16: ZeRO mixed precision (low-precision model, fp32 masters)")
    a = ap.parse_args()
    # NOTE: glibc serves big blocks from mmap only below a threshold that grows as blocks
    # are freed; pinning it makes freed tensors leave the RSS at once, so peak RSS follows
    # live memory. Set before spawning: the ranks read it at startup.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    psi = sum(p.numel() for p in make_mlp(a.width, a.depth).parameters())
    mib = 2**20
    print(f"MLP {a.depth}x{a.width} ({psi / 1e6:.2f} M params, model states 16 Psi = "
          f"{16 * psi / mib:.0f} MiB), AdamW, {a.precision}, world {a.world}, per-rank batch "
          f"{a.batch}, buckets {a.bucket_mb:g} MiB\n")
    if "memory" in a.parts:
        memory_table(a, psi)
    if "time" in a.parts:
        time_table(a)


def memory_table(a, psi: int) -> None:
    mib = 2**20
    print("| variant | params MiB | grads MiB | optimizer MiB | total MiB | paper MiB "
          "| stage-3 gathered peak MiB | peak RSS growth MiB | MB sent/step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for v in variants(a.precision):
        r = spawn(memory_rank, a.world, v, a.width, a.depth, a.batch, a.mem_steps, a.bucket_mb,
                  a.precision, timeout=600, collective_timeout=300)[0]
        peers = {"dp": 0, "torch_zero1": 1, "torch_fsdp": 3}
        stage = peers[v] if v in peers else int(v[-1])
        want = plan.model_state_bytes(psi, a.world, stage, "adamw",
                                      "fp32" if a.precision == "fp32" else "mixed").total
        total = r["params"] + r["grads"] + r["optimizer"]
        peak = "-" if not r["engine_peak"] else f"{r['engine_peak'] / mib:.1f}"
        sent = "-" if r["sent"] is None else f"{r['sent'] / 1e6:.1f}"
        print(f"| {v} | {r['params'] / mib:.1f} | {r['grads'] / mib:.1f} | "
              f"{r['optimizer'] / mib:.1f} | {total / mib:.1f} | {want / mib:.1f} | {peak} | "
              f"{r['rss_growth'] / mib:.0f} | {sent} |", flush=True)


def time_table(a) -> None:
    times = spawn(time_rank, a.world, a.width, a.depth, a.batch, a.steps, a.rounds, a.warmup,
                  a.bucket_mb, a.precision, timeout=1200, collective_timeout=300)[0]
    names = variants(a.precision)
    med = {v: statistics.median(t) * 1e3 for v, t in times.items()}
    base = "dp" if "dp" in med else "zero0"
    print(f"\nmedian step time (ms), {a.rounds} rounds x {a.steps} steps, interleaved, "
          f"{a.precision}; ratios to {base}")
    print("| " + " | ".join(names) + " |\n|" + "---|" * len(names))
    print("| " + " | ".join(f"{med[v]:.0f} ({med[v] / med[base]:.2f}x)" for v in names) + " |")


if __name__ == "__main__":
    main()
