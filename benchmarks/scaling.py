"""Data-parallel scaling on emulated clusters: the seeds' claims as experiments.

    python benchmarks/scaling.py nodes  --link 1gbit --nodes 1 2 4 8 --cpus-per-node 0.25
    python benchmarks/scaling.py layout --link 1gbit --procs 8 --cpus-per-proc 0.25   # 1x8 .. 8x1
    python benchmarks/scaling.py ps --link 1gbit --workers 4 --servers 1 2 4 --hidden 2048

Needs root (clusters `dt-sc*`, removed afterwards). `nodes` (experiment a): the digits
MLP (64 -> H -> H -> 10, real scikit-learn digits) under disttrain.DataParallel with a
fixed batch per rank (weak scaling), one rank per node, every node the same CPU quota;
prints samples/s, the efficiency against one node (throughput_N / (N x throughput_1))
and the alpha-beta prediction: step(N) = compute(1) + allreduce(gradient bytes, N) with
alpha and B given on the command line (fit them with benchmarks/allreduce.py).
`layout` (experiment c): the same job as P processes on P/k nodes of k for every k.
`ps` (experiment d): the same MLP, batch and link, W workers one per node, trained with
parameter servers (Sync policy; S servers, each on a node of its own, so a cluster of W+S
nodes) and with a ring allreduce of the flat gradient (disttrain.comm.algorithms, a
cluster of the W worker nodes). Model: every worker pushes its P gradient bytes and
pulls P parameter bytes over the S server links, so push and pull each take
max(W f, 1) P/B, f the busiest server's share of P (the consistent-hash placement of
the keys, tensors cut at 4 MB: with --hidden 1024 one 4 MB layer is 94 % of P, so use
2048), and a step compute + 2 max(W f, 1) P/B + 2 alpha; ring:
compute + 2(W-1)/W P/B + 2(W-1) alpha. The compute is the forward+backward time the
ring job measures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


def _digits(args, g):
    """The digits MLP and a sampler of `batch` real digits."""
    import torch
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32) / 16, torch.tensor(y)
    net = _mlp(args.hidden)

    def next_batch():
        idx = torch.randint(0, len(x), (args.batch,), generator=g)
        return x[idx], y[idx]
    return net, next_batch


def _gpt(args, g):
    """examples/gpt_char.py's model (4 layers, 64 wide, 64 tokens) on stdlib source text."""
    import torch

    from disttrain.models import GPT, GPTConfig
    from disttrain.models.text import batches, encode, stdlib_text

    torch.manual_seed(0)
    loader = batches(encode(stdlib_text()), args.batch, 64, g)
    return GPT(GPTConfig()), lambda: next(loader)


def inner(args) -> None:
    """One rank: time `steps` DataParallel steps after `warmup` (run inside the cluster)."""
    import torch
    import torch.distributed as dist

    import disttrain

    torch.set_num_threads(1)
    disttrain.init()
    g = torch.Generator().manual_seed(disttrain.rank())
    net, next_batch = _gpt(args, g) if args.model == "gpt" else _digits(args, g)
    model = disttrain.DataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(args.warmup + args.steps):
        if step == args.warmup:  # NOTE: wall time over all steps: throttled periods count
            dist.barrier()
            t0 = time.perf_counter()
        x, y = next_batch()
        opt.zero_grad()
        out = model(x)
        torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
        opt.step()
    t = torch.tensor([(time.perf_counter() - t0) / args.steps], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if disttrain.rank() == 0:
        grad_bytes = sum(p.numel() * 4 for p in net.parameters())
        with open(args.out, "w") as f:
            json.dump({"step_s": t.item(), "grad_bytes": grad_bytes,
                       "world": disttrain.world_size()}, f)
    disttrain.shutdown()


def _mlp(h: int):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, h), torch.nn.ReLU(), torch.nn.Linear(h, h),
                               torch.nn.ReLU(), torch.nn.Linear(h, 10))


def inner_ps(args) -> None:
    """One rank of experiment (d): PS worker/server, or (no servers) a ring-allreduce worker."""
    import statistics

    import torch
    from sklearn.datasets import load_digits

    import disttrain
    from disttrain import ps
    from disttrain.comm.algorithms import all_reduce

    torch.set_num_threads(1)
    disttrain.init()
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32) / 16, torch.tensor(y)
    net = _mlp(args.hidden)
    params = list(net.parameters())
    conn = (ps.connect(net, ps.Sync(), optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
            if disttrain.runtime.num_servers() else None)  # a server serves and exits here
    opt = None if conn else torch.optim.SGD(params, lr=0.01)
    g = torch.Generator().manual_seed(disttrain.rank())
    compute, t0 = [], time.perf_counter()
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            t0 = time.perf_counter()
        idx = torch.randint(0, len(x), (args.batch,), generator=g)
        if conn:
            conn.pull().wait()
        net.zero_grad()
        c0 = time.perf_counter()
        try:  # NOTE: a Sync round can close without a late worker (README's loop)
            torch.nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
            compute.append(time.perf_counter() - c0)
            if conn:
                conn.push().wait()
                continue
        except ps.Cancelled:
            continue
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        all_reduce(flat, algorithm="ring")
        torch.nn.utils.vector_to_parameters(flat / disttrain.world_size(), [p.grad for p in params])
        opt.step()
    step_s = (time.perf_counter() - t0) / args.steps
    if conn:
        conn.close()
    if disttrain.rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"step_s": step_s, "compute_s": statistics.median(compute[args.warmup:]),
                       "grad_bytes": sum(p.numel() * 4 for p in params)}, f)
    if not conn:
        disttrain.shutdown()


def ps_experiment(args) -> list[dict]:
    from disttrain.comm.cost import Links, predict
    from disttrain.ps.placement import plan_keys

    links = Links(alpha=args.alpha_us * 1e-6, link_Bps=args.fit_gbps * 1e9 / 8)
    w, rows = args.workers, []
    for servers in [0, *args.servers]:
        sizes = {"workers": w, "servers": servers} if servers else {"nproc_per_node": 1}
        row = one(w + servers, 1, args, "inner-ps", sizes)
        row.update(servers=servers)
        rows.append(row)
        print(f"{w} workers, {servers} servers: step {row['step_s'] * 1e3:.1f} ms", file=sys.stderr)
    compute, p = rows[0]["compute_s"], rows[0]["grad_bytes"]
    shapes = [(n, t.numel(), 4) for n, t in _mlp(args.hidden).named_parameters()]
    print(f"\nps: link {args.link}, {w} workers one per node, MLP hidden {args.hidden} "
          f"({p / 1e6:.2f} MB), batch {args.batch}/worker; model alpha {args.alpha_us:g} us, "
          f"B {args.fit_gbps:g} Gbit/s, compute {compute * 1e3:.1f} ms (measured)")
    print("| method | nodes | busiest server's share | step ms | model step ms | error | samples/s | vs ring |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["servers"]
        # NOTE: the busiest server's link carries W x its share of P each way; keys are
        # placed with bounded loads (placement.py), so no share is over 1.25x the mean
        share = max(sum(c.numel for c in keys) * 4 for keys in plan_keys(shapes, s)) / p if s else 0
        model = compute + (predict("ring", p, w, 1, links) if not s else
                           2 * max(w * share, 1) * p / links.link_Bps + 2 * links.alpha)
        name = f"parameter server, S = {s}" if s else "ring allreduce"
        print(f"| {name} | {r['nodes']} | {f'{share:.2f}' if s else '-'} | {r['step_s'] * 1e3:.1f} | {model * 1e3:.1f} | "
              f"{r['step_s'] / model - 1:+.0%} | {w * args.batch / r['step_s']:.0f} | "
              f"{rows[0]['step_s'] / r['step_s']:.2f} |")
        r["model_s"] = model
    return rows


def one(nodes: int, ppn: int, args, inner_name: str = "inner", sizes=None) -> dict:
    from disttrain.cluster import net, run, spec

    name = f"sc{os.getpid() % 10000}"
    net.down(name)
    cpus = args.cpus_per_proc * ppn if args.cpus_per_proc else args.cpus_per_node
    net.up(spec.Cluster(name, nodes, spec.parse_rate(args.link), "switch", cpus_per_node=cpus))
    out = tempfile.mktemp(suffix=".json")
    try:
        with open(out + ".log", "w+") as sink:
            code = run.run_in_cluster(
                name, os.path.abspath(__file__),
                [inner_name, "--out", out, "--hidden", str(args.hidden), "--batch", str(args.batch),
                 "--model", args.model,
                 "--steps", str(args.steps), "--warmup", str(args.warmup)],
                **(sizes or {"nproc_per_node": ppn}), out=sink)
            sink.seek(0)
            lines = sink.readlines()
        if code:
            raise RuntimeError(f"{nodes}x{ppn} exited {code}; its last lines:\n" + "".join(lines[-40:]))
        with open(out) as f:
            row = json.load(f)
    finally:
        net.down(name)
        for path in (out, out + ".log"):
            if os.path.exists(path):
                os.remove(path)
    row.update(nodes=nodes, ppn=ppn,
               samples_s=row.get("world", nodes * ppn) * args.batch / row["step_s"])
    return row


def predicted_step(compute_s: float, grad_bytes: int, nodes: int, ppn: int, args) -> float:
    from disttrain.comm.cost import Links, predict

    links = Links(alpha=args.alpha_us * 1e-6, link_Bps=args.fit_gbps * 1e9 / 8)
    return compute_s + predict("ring", grad_bytes, nodes * ppn, ppn, links)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("experiment", choices=("nodes", "layout", "ps", "inner", "inner-ps"))
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
    p.add_argument("--model", default="mlp", choices=("mlp", "gpt"),
                   help="nodes/layout: the digits MLP or examples/gpt_char.py's GPT (--batch sequences)")
    p.add_argument("--workers", type=int, default=4, help="ps: workers (one per node)")
    p.add_argument("--servers", type=int, nargs="+", default=[1, 2, 4], help="ps: server counts")
    p.add_argument("--json")
    args = p.parse_args()
    if args.experiment in ("inner", "inner-ps"):
        return (inner if args.experiment == "inner" else inner_ps)(args)
    if args.experiment == "ps":
        rows = ps_experiment(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    layouts = ([(n, 1) for n in args.nodes] if args.experiment == "nodes" else
               [(args.procs // k, k) for k in (args.procs, 4, 2, 1) if args.procs % k == 0])
    rows = [one(n, k, args) for n, k in layouts]
    base = rows[0]
    compute = base["step_s"] if base["world"] == 1 else None
    quota = (f"{args.cpus_per_proc:g} cores per process" if args.cpus_per_proc else
             f"{args.cpus_per_node:g} cores per node" if args.cpus_per_node else "no CPU quota")
    what = "GPT (examples/gpt_char.py)" if args.model == "gpt" else f"MLP hidden {args.hidden}"
    print(f"\n{args.experiment}: link {args.link}, {quota}, "
          f"{what} ({base['grad_bytes'] / 1e6:.2f} MB of gradients), batch {args.batch}/rank")
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
