"""What one blocking all-reduce costs between two ranks that compute around it, here.

Run by `disttrain plan profile --ranks N` (plan/profile_shared.py): N processes on this
machine, one intra-op thread each, a gloo group over a FileStore in a temporary folder,
ranks paired (0, 1), (2, 3), ... as tensor-parallel pairs are. Each process times three
loops of `ITERS` iterations: compute alone (matmuls of about a millisecond), the pair's
all-reduce of `nbytes` alone, and compute followed by the all-reduce, as a
tensor-parallel layer issues it. The file records, per N, medians over ranks of:
`inline_s`, (compute + all-reduce) - compute, the seconds a blocking collective adds to
ranks that compute around it; `call_s`, the wall seconds of the all-reduce call itself
inside the third loop (the wait for a peer whose compute ran late and the hand-offs to
gloo's threads included); `both_s`, the third loop's iteration; `compute_cpu_s`, the
process time of one compute iteration (its duration alone). With ranks that alternate
compute and blocking collectives (a tensor-parallel layer) the call takes most of the
difference while the compute between calls runs faster than beside N - 1 ranks that
never block: 2 cores, N = 8, 256 KiB, a loaded machine: compute loop 13-19 ms, third
loop 12-16 ms of which the call 6.1-7.7 ms, for 2.0 ms of compute CPU.

    python -m disttrain.plan.profile_sync RANK WORLD STORE NBYTES OUT
"""

from __future__ import annotations

import json
import statistics
import sys
import time

ITERS = 100
"""Iterations per loop; the median of 3 loops is kept."""


def _loops(nbytes: int) -> tuple[float, float, float, float, float]:
    """(compute, all-reduce, compute + all-reduce) seconds per iteration, medians of 3, the
    median wall seconds of the all-reduce call itself inside the third loop, and the CPU
    seconds (process time: its duration alone) of one compute iteration."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    pairs = [dist.new_group([i, i + 1]) for i in range(0, world - 1, 2)]
    group = pairs[min(rank // 2, len(pairs) - 1)]
    buf = torch.zeros(max(1, nbytes // 4))
    x = torch.randn(128, 128)

    def compute():
        for _ in range(40):
            x @ x

    cpu = []

    def loop(work) -> float:
        dist.barrier()
        t, c = time.perf_counter(), time.process_time()
        for _ in range(ITERS):
            work()
        cpu.append((time.process_time() - c) / ITERS)
        return (time.perf_counter() - t) / ITERS

    def reduce():
        dist.all_reduce(buf, group=group)

    calls = []

    def both():
        compute()
        t = time.perf_counter()
        reduce()
        calls.append(time.perf_counter() - t)

    out = []
    for work in (compute, reduce, both):
        out.append(statistics.median(loop(work) for _ in range(3)))
    return out[0], out[1], out[2], statistics.median(calls), statistics.median(cpu[:3])


def main(argv: list[str]) -> int:
    rank, world, store, nbytes, out = int(argv[0]), int(argv[1]), argv[2], int(argv[3]), argv[4]
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        mine = torch.tensor(_loops(nbytes), dtype=torch.float64)
        rows = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(rows, mine)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        med = [statistics.median(float(r[i]) for r in rows) for i in range(5)]
        with open(out, "w") as f:
            json.dump({"bytes": nbytes, "compute_s": med[0], "alone_s": med[1],
                       "inline_s": max(0.0, med[2] - med[0]), "both_s": med[2],
                       "call_s": med[3], "compute_cpu_s": med[4]}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
