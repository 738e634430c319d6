"""A small traced data-parallel job: MLP on random data, one rank may sleep in its loader.

    disttrain run --nproc 2 --trace DIR tests/e2e/scripts/traced_dp.py [--steps N]
        [--slow-rank R --slow-ms MS] [--crash-at STEP] [--step-times FILE]

--step-times writes this rank's own measured step times (seconds, one per line), the
reference the tests compare the trace's metrics with.
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import disttrain

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--slow-rank", type=int, default=-1)
parser.add_argument("--slow-ms", type=float, default=0.0)
parser.add_argument("--crash-at", type=int, default=-1)
parser.add_argument("--hang-at", type=int, default=-1)
parser.add_argument("--step-times", default="")
args = parser.parse_args()

disttrain.init()
rank = disttrain.rank()
torch.manual_seed(0)


class Slow(torch.utils.data.Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(n, 32, generator=g), torch.randint(0, 4, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if rank == args.slow_rank and i % 16 == 0:
            time.sleep(args.slow_ms / 1000)
        return self.x[i], self.y[i]


loader = disttrain.data.shard_loader(Slow(4096), 32 * disttrain.world_size(), seed=0)
model = disttrain.DataParallel(nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
times, step = [], 0
t_prev = time.perf_counter()
for x, y in loader:
    if step == args.crash_at and rank == 1:
        raise RuntimeError(f"injected crash at step {step}")
    if step == args.hang_at:
        print(f"rank {rank} waiting at step {step}", flush=True)
        time.sleep(600)
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    disttrain.log(loss=loss.item())
    step += 1
    now = time.perf_counter()
    times.append(now - t_prev)
    t_prev = now
    if step >= args.steps:
        break
if args.step_times:
    with open(os.path.join(args.step_times, f"steps.rank{rank}.txt"), "w") as fp:
        fp.write("\n".join(repr(t) for t in times))
disttrain.print0("done")
disttrain.shutdown()
