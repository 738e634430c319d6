"""Data-parallel scaling on emulated clusters: the seeds' claims as experiments.

    python benchmarks/scaling.py nodes  --link 1gbit --nodes 1 2 4 8 --cpus-per-node 0.25
    python benchmarks/scaling.py layout --link 1gbit --procs 8 --cpus-per-proc 0.25   # 1x8 .. 8x1

Needs root (clusters `dt-sc*`, removed afterwards). `nodes` (experiment a): the digits
MLP (64 -> H -> H -> 10, real scikit-learn digits) under disttrain.DataParallel with a
fixed batch per rank (weak scaling), one rank per node, every node the same CPU quota;
prints samples/s, the efficiency against one node (throughput_N / (N x throughput_1))
and the alpha-beta prediction: step(N) = compute(1) + allreduce(gradient bytes, N) with
alpha and B given on the command line (fit them with benchmarks/allreduce.py).
`layout` (experiment c): the same job as P processes on P/k nodes of k for every k.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def inner(args) -> None:
    """One rank: time `steps` DataParallel steps after `warmup` (run inside the cluster)."""
    import torch
    import torch.distributed as dist
    from sklearn.datasets import load_digits

    import disttrain

    torch.set_num_threads(1)
    disttrain.init()
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32) / 16, torch.tensor(y)
    torch.manual_seed(0)
    h = args.hidden
    net = torch.nn.Sequential(torch.nn.Linear(64, h), torch.nn.ReLU(), torch.nn.Linear(h, h),
                              torch.nn.ReLU(), torch.nn.Linear(h, 10))
    model = disttrain.DataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(disttrain.rank())
    for step in range(args.warmup + args.steps):
        if step == args.warmup:  # NOTE: wall time over all steps: throttled periods count
            dist.barrier()
            t0 = time.perf_counter()
        idx = torch.randint(0, len(x), (args.batch,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    t = torch.tensor([(time.perf_counter() - t0) / args.steps], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if disttrain.rank() == 0:
        grad_bytes = sum(p.numel() * 4 for p in net.parameters())
        with open(args.out, "w") as f:
            json.dump({"step_s": t.item(), "grad_bytes": grad_bytes,
                       "world": disttrain.world_size()}, f)
    disttrain.shutdown()


def one(nodes: int, ppn: int, args) -> dict:
    from disttrain.cluster import net, run, spec

    name = f"sc{os.getpid() % 10000}"
    net.down(name)
    cpus = args.cpus_per_proc * ppn if args.cpus_per_proc else args.cpus_per_node
    net.up(spec.Cluster(name, nodes, spec.parse_rate(args.link), "switch", cpus_per_node=cpus))
    out = tempfile.mktemp(suffix=".json")
    try:
        with open(os.devnull, "w") as sink:
            code = run.run_in_cluster(
                name, os.path.abspath(__file__),
                ["inner", "--out", out, "--hidden", str(args.hidden), "--batch", str(args.batch),
                 "--steps", str(args.steps), "--warmup", str(args.warmup)],
                nproc_per_node=ppn, out=sink)
        if code:
            raise RuntimeError(f"{nodes}x{ppn} exited {code}")
        with open(out) as f:
            row = json.load(f)
    finally:
        net.down(name)
        if os.path.exists(out):
            os.remove(out)
    row.update(nodes=nodes, ppn=ppn, samples_s=row["world"] * args.batch / row["step_s"])
    return row


def predicted_step(compute_s: float, grad_bytes: int, nodes: int, ppn: int, args) -> float:
    from disttrain.cluster.model import Links, predict

    links = Links(alpha=args.alpha_us * 1e-6, link_Bps=args.fit_gbps * 1e9 / 8)
    return compute_s + predict("ring", grad_bytes, nodes * ppn, ppn, links)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("experiment", choices=("nodes", "layout", "inner"))
    p.add_argument("--link", default="1gbit")
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--procs", type=int, default=8)
    p.add_argument("--cpus-per-node", type=float, default=None)
    p.add_argument("--cpus-per-proc", type=float, default=None,
                   help="layout: quota per node = this x processes on the node")
    p.add_argument("--hidden", type=int, default=512, help="MLP width (gradient = ~4 (64H + H^2) bytes)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--alpha-us", type=float, default=1700.0, help="model alpha (allreduce.py fit)")
    p.add_argument("--fit-gbps", type=float, default=0.92, help="model B, Gbit/s (allreduce.py fit)")
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--json")
    args = p.parse_args()
    if args.experiment == "inner":
        return inner(args)
    layouts = ([(n, 1) for n in args.nodes] if args.experiment == "nodes" else
               [(args.procs // k, k) for k in (args.procs, 4, 2, 1) if args.procs % k == 0])
    rows = [one(n, k, args) for n, k in layouts]
    base = rows[0]
    compute = base["step_s"] if base["world"] == 1 else None
    quota = (f"{args.cpus_per_proc:g} cores per process" if args.cpus_per_proc else
             f"{args.cpus_per_node:g} cores per node" if args.cpus_per_node else "no CPU quota")
    print(f"\n{args.experiment}: link {args.link}, {quota}, "
          f"MLP hidden {args.hidden} ({base['grad_bytes'] / 1e6:.2f} MB of gradients), batch {args.batch}/rank")
    print("| nodes x procs | step ms | samples/s | efficiency vs first row | model step ms |")
    print("|---|---|---|---|---|")
    for r in rows:
        eff = r["samples_s"] / (base["samples_s"] * r["world"] / base["world"])
        model = (f"{predicted_step(compute, r['grad_bytes'], r['nodes'], r['ppn'], args) * 1e3:.1f}"
                 if compute else "-")
        print(f"| {r['nodes']}x{r['ppn']} | {r['step_s'] * 1e3:.1f} | {r['samples_s']:.0f} | {eff:.2f} | {model} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
