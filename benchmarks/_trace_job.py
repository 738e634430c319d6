"""One job of benchmarks/trace_overhead.py: N steps of dp | pp | ps, step times to a file.

    disttrain run --nproc 2 [--trace DIR] benchmarks/_trace_job.py dp OUT.json --steps N
    disttrain run --nproc 2 [--trace DIR] benchmarks/_trace_job.py pp OUT.json --steps N
    disttrain run --workers 2 --servers 1 [--trace DIR] benchmarks/_trace_job.py ps OUT.json

Rank 0 (worker 0) writes its own wall-clock time of every step (perf_counter around the
whole step, loader included) as JSON to OUT.json: the same measure with tracing on or off.
With `--toggle K --toggle-dir D` the job traces itself in alternate blocks of K
steps (`disttrain.trace.start(D/blockN)` ... `stop()`, off first), and OUT.json says which
steps were traced.
"""

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import disttrain
from disttrain import ps
from disttrain.models import GPT, GPTConfig

parser = argparse.ArgumentParser()
parser.add_argument("mode", choices=["dp", "pp", "ps"])
parser.add_argument("out")
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--pp-width", type=int, default=32, help="pp: the GPT's n_embd (4 heads above 32)")
parser.add_argument("--dp-width", type=int, default=256, help="dp, ps: the MLP's hidden width")
parser.add_argument("--toggle", type=int, default=0, help="blocks of this many steps, tracing "
                    "off and on in turn (disttrain.trace.start/stop in this process)")
parser.add_argument("--toggle-dir", default="", help="with --toggle: where the traced blocks go")
args = parser.parse_args()
disttrain.init()
torch.manual_seed(0)


def mlp():
    w = args.dp_width
    return nn.Sequential(nn.Linear(64, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 10))


def data(per_rank_batch, world):
    g = torch.Generator().manual_seed(1)
    n = per_rank_batch * world * (args.steps + 1)
    ds = torch.utils.data.TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))
    return disttrain.data.shard_loader(ds, per_rank_batch * world, seed=0)


def run_dp():
    model = disttrain.DataParallel(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    it = iter(data(64, disttrain.world_size()))

    def step():
        x, y = next(it)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return step


def run_pp():
    w = args.pp_width
    cfg = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2 if w <= 32 else 4, n_embd=w)
    mesh = disttrain.Mesh(pp=disttrain.world_size())
    model = disttrain.parallelize(GPT(cfg), mesh, GPT.tp_plan, disttrain.Parallelism(
        schedule="1f1b", microbatches=4, optimizer_factory=lambda p: torch.optim.AdamW(p, lr=1e-3)))
    opt = model.optimizer
    g = torch.Generator().manual_seed(2)

    def step():
        x = torch.randint(0, 128, (16, 32), generator=g)
        opt.zero_grad(set_to_none=True)
        model.train_step(x, torch.roll(x, -1, 1))
        opt.step()
    return step


def run_ps():
    net = mlp()
    global conn
    conn = ps.connect(net, ps.Sync(), optimizer=lambda p: torch.optim.SGD(p, lr=0.05))  # servers stay here
    it = iter(data(64, disttrain.world_size() - disttrain.runtime.num_servers()))

    def step():
        conn.pull().wait()
        x, y = next(it)
        net.zero_grad(set_to_none=True)
        try:
            F.cross_entropy(net(x), y).backward()
            conn.push().wait()
        except ps.Cancelled:  # NOTE: Sync may close a round without this worker: a real step's cost
            pass
    return step


step = {"dp": run_dp, "pp": run_pp, "ps": run_ps}[args.mode]()
times, cpu, traced = [], [], []
for i in range(args.steps):
    on = bool(args.toggle) and (i // args.toggle) % 2 == 1
    if args.toggle and i % args.toggle == 0 and on:  # NOTE: ps: the workers alone (the server serves)
        disttrain.trace.start(os.path.join(args.toggle_dir, f"block{i}"), align=args.mode != "ps")
    t0, c0 = time.perf_counter(), time.process_time()
    step()
    times.append(time.perf_counter() - t0)
    cpu.append(time.process_time() - c0)  # NOTE: this process's threads, the trace writer's too
    traced.append(on)
    if on and (i + 1) % args.toggle == 0:
        disttrain.trace.stop(merge_files=args.mode != "ps")
if disttrain.rank() == 0:
    with open(args.out, "w") as fp:
        json.dump({"wall": times, "cpu": cpu, "traced": traced}, fp)
if args.mode == "ps":
    conn.close()
disttrain.shutdown()
