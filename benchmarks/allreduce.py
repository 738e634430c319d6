"""Allreduce algorithms on emulated clusters against gloo's own and the alpha-beta model.

    python benchmarks/allreduce.py                        # 2 and 4 nodes x 1, 2 ranks, 1gbit
    python benchmarks/allreduce.py --nodes 2 4 8 --ppn 1 2 --link 1gbit 10gbit \
        --sizes 64K 256K 1M 4M 16M 64M --json out.json

Needs root (it brings up `dt-ab*` clusters and removes them). For every cluster
(switch topology, N nodes x K ranks) and size S it times each algorithm (median of
repetitions; one repetition = the slowest rank's time for one allreduce after a
barrier) and reports bus bandwidth = 2(N-1)/N S / t, as NCCL-tests do. Then it fits
the model of disttrain/comm/cost.py once per link rate (alpha and B from the ring
rows, least squares; the local alpha and bandwidth from a 1-node, 2-rank run), prints
each row's predicted time and error, what `auto` (model.choose_algorithm with the fitted
links) would pick, and checks the issue's targets.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ALGOS = ("native", "ring", "halving-doubling", "tree", "hierarchical")
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    return int(float(text[:-1]) * UNITS[text[-1].upper()]) if text[-1].upper() in UNITS else int(text)


def inner(args) -> None:
    """One rank of the timing job (started by run_in_cluster on every node)."""
    import torch
    import torch.distributed as dist

    import disttrain
    from disttrain.comm.algorithms import all_reduce

    torch.set_num_threads(1)
    disttrain.init()
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    rows = []
    flag = torch.zeros(1)
    for size in map(parse_size, args.sizes):
        t = torch.ones(size // 4)
        reps = max(3, min(args.max_reps, (16 << 20) // max(size, 1)))
        for algo in args.algos:
            if algo == "hierarchical" and local in (1, disttrain.world_size()):
                continue
            all_reduce(t, algorithm=algo, local_size=local)  # warm-up: connections, buffers
            times = []
            for _ in range(reps):
                dist.all_reduce(flag)  # barrier
                t0 = time.perf_counter()
                all_reduce(t, algorithm=algo, local_size=local)
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                times.append(dt.item())
            rows.append({"algo": algo, "bytes": size, "t": statistics.median(times), "reps": reps})
    if disttrain.rank() == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)
    disttrain.shutdown()


def measure(nodes: int, ppn: int, link: str, sizes, max_reps: int, cpus: float | None,
            algos=ALGOS, topology: str = "switch", switch: str | None = None) -> list[dict]:
    from disttrain.cluster import net, run, spec

    name = f"ab{os.getpid() % 10000}"
    net.down(name)
    net.up(spec.Cluster(name, nodes, spec.parse_rate(link), topology,
                        spec.parse_rate(switch) if switch else None, cpus_per_node=cpus))
    out = tempfile.mktemp(suffix=".json")
    try:
        with open(os.devnull, "w") as sink:
            code = run.run_in_cluster(name, os.path.abspath(__file__),
                                      ["--inner", "--out", out, "--max-reps", str(max_reps),
                                       "--algos", *algos, "--sizes", *sizes],
                                      nproc_per_node=ppn, out=sink)
        if code:
            raise RuntimeError(f"timing job on {nodes}x{ppn} at {link} exited {code}")
        with open(out) as f:
            rows = json.load(f)
    finally:
        net.down(name)
        if os.path.exists(out):
            os.remove(out)
    for r in rows:
        n = nodes * ppn
        r.update(nodes=nodes, ppn=ppn, link=link, topology=topology, switch=switch, busbw=2 * (n - 1) / n * r["bytes"] / r["t"] * 8 / 1e9)
    return rows


def fit(rows: list[dict]) -> tuple[float, float]:
    """Least squares of t = 2(N-1) alpha + 2(N-1)/N S / B over ring rows; (alpha, B bytes/s)."""
    xs, ys = [], []
    for r in rows:
        n = r["nodes"] * r["ppn"]
        xs.append((2 * (n - 1), 2 * (n - 1) / n * r["bytes"]))
        ys.append(r["t"])
    # NOTE: relative errors matter (planning), so weight each row by 1/t
    a11 = sum((x[0] / y) ** 2 for x, y in zip(xs, ys))
    a12 = sum(x[0] * x[1] / y ** 2 for x, y in zip(xs, ys))
    a22 = sum((x[1] / y) ** 2 for x, y in zip(xs, ys))
    b1 = sum(x[0] / y for x, y in zip(xs, ys))
    b2 = sum(x[1] / y for x, y in zip(xs, ys))
    det = a11 * a22 - a12 * a12
    if len({x[1] for x in xs}) < 2 or det <= 0:
        raise ValueError("the alpha-beta fit needs ring rows at two sizes or more: pass --sizes A B")
    alpha, inv_b = (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det
    return max(alpha, 1e-6), 1 / max(inv_b, 1e-15)


def fit_cpu(rows: list[dict]):
    """The model with its CPU terms fitted to every algorithm's rows (1-node rows included):
    least squares of log(predicted / measured), so relative errors count; one CPU pool
    shared by all nodes (they share this machine)."""
    import numpy as np
    from scipy.optimize import least_squares

    from disttrain.comm.cost import Links, predict

    def links(x):
        v = np.exp(x)
        return Links(alpha=v[0], local_alpha=v[1], step_alpha=v[2], link_Bps=1 / v[3], local_Bps=1 / v[4],
                     cpu_Bps=1 / v[5], cpu_local_Bps=1 / v[6], shared_cpu=True)

    def residuals(x):
        m = links(x)
        return [np.log(predict(r["algo"], r["bytes"], r["nodes"] * r["ppn"], r["ppn"], m) / r["t"])
                for r in rows]

    start = np.log([3e-4, 3e-4, 1e-4, 8e-9, 1e-9, 3e-9, 3e-10])
    return links(least_squares(residuals, start, bounds=(np.log(1e-12), np.log(1.0))).x)


def env_line(m) -> str:
    return (f"DISTTRAIN_ALPHA_US={m.alpha * 1e6:.0f} DISTTRAIN_STEP_US={m.step_alpha * 1e6:.0f} "
            f"DISTTRAIN_CPU_GBPS={m.cpu_Bps * 8 / 1e9:.3g} DISTTRAIN_CPU_LOCAL_GBPS={m.cpu_local_Bps * 8 / 1e9:.3g} "
            f"DISTTRAIN_LOCAL_ALPHA_US={m.local_alpha * 1e6:.0f} DISTTRAIN_LOCAL_GBPS={m.local_Bps * 8 / 1e9:.3g} "
            "DISTTRAIN_SHARED_CPU=1")


def report(rows: list[dict]) -> dict:
    from disttrain.comm.cost import Links, choose_algorithm, predict

    local_rows = [r for r in rows if r["nodes"] == 1]
    local = fit(local_rows)
    links, plain = {}, {}
    for link in sorted({r["link"] for r in rows if r["nodes"] > 1}):
        these = [r for r in rows if r["link"] == link and r["nodes"] > 1 and r["algo"] != "native"]
        alpha, bps = fit([r for r in these if r["algo"] == "ring"])
        plain[link] = Links(alpha, bps, local[0], local[1])
        links[link] = m = fit_cpu(these + ([r for r in local_rows if r["link"] == link] or local_rows))
        print(f"\nalpha-beta fit at {link} (ring rows): alpha = {alpha * 1e6:.0f} us, B = "
              f"{bps * 8 / 1e9:.3f} Gbit/s (local: alpha {local[0] * 1e6:.0f} us, {local[1] * 8 / 1e9:.2f} Gbit/s)")
        print(f"model with the CPU term at {link} (all rows): alpha = {m.alpha * 1e6:.0f} us, B = "
              f"{m.link_Bps * 8 / 1e9:.3f} Gbit/s, per sender and step {m.step_alpha * 1e6:.0f} us, "
              f"CPU pool {m.cpu_Bps * 8 / 1e9:.2f} Gbit/s across nodes, {m.cpu_local_Bps * 8 / 1e9:.2f} inside; "
              f"local alpha {m.local_alpha * 1e6:.0f} us, {m.local_Bps * 8 / 1e9:.2f} Gbit/s\n  to plan with it: "
              f"{env_line(m)}")
    print("\n| link | nodes x ppn | size | algorithm | time ms | busbw Gbit/s | model ms | error "
          "| alpha-beta ms | error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["nodes"] == 1:
            continue
        n, k = r["nodes"] * r["ppn"], r["ppn"]
        r["model"] = predict(r["algo"], r["bytes"], n, k, links[r["link"]])
        r["err"] = r["t"] / r["model"] - 1
        r["ab_model"] = predict(r["algo"], r["bytes"], n, k, plain[r["link"]])
        r["ab_err"] = r["t"] / r["ab_model"] - 1
        print(f"| {r['link']} | {r['nodes']}x{r['ppn']} | {_fmt(r['bytes'])} | {r['algo']} | "
              f"{r['t'] * 1e3:.2f} | {r['busbw']:.3f} | {r['model'] * 1e3:.2f} | {r['err']:+.0%} | "
              f"{r['ab_model'] * 1e3:.2f} | {r['ab_err']:+.0%} |")
    return targets(rows, links, choose_algorithm)


def targets(rows, links, choose) -> dict:
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if r["nodes"] > 1:
            groups.setdefault((r["link"], r["nodes"], r["ppn"], r["bytes"]), {})[r["algo"]] = r
    out = {"ring_busbw": [], "model": [], "ab_model": [], "best_vs_gloo": [], "auto": []}
    print("\n| link | nodes x ppn | size | best | best ms | gloo ms | auto picks | auto / best |")
    print("|---|---|---|---|---|---|---|---|")
    for (link, nodes, ppn, size), by in sorted(groups.items()):
        ours = {a: r for a, r in by.items() if a != "native"}
        best = min(ours.values(), key=lambda r: r["t"])
        pick = choose(size, nodes * ppn, ppn, links[link])
        if pick not in by:  # --algos left out what auto would pick
            print(f"| {link} | {nodes}x{ppn} | {_fmt(size)} | {best['algo']} | {best['t'] * 1e3:.2f} | "
                  f"{by['native']['t'] * 1e3:.2f} | {pick} (not measured) | - |")
            continue
        auto = by[pick]["t"] / best["t"]
        print(f"| {link} | {nodes}x{ppn} | {_fmt(size)} | {best['algo']} | {best['t'] * 1e3:.2f} | "
              f"{by['native']['t'] * 1e3:.2f} | {pick} | {auto:.2f} |")
        if size >= 16 << 20:
            out["ring_busbw"].append(by["ring"]["busbw"] * 1e9 / _bps(link))
        if size >= 1 << 20:
            out["model"] += [abs(r["err"]) for r in ours.values()]
            out["ab_model"] += [abs(r["ab_err"]) for r in ours.values()]
        if size >= 4 << 20:
            out["best_vs_gloo"].append(by["native"]["t"] / best["t"])
        out["auto"].append(auto)
    print("\ntargets:")
    for key, goal, ok in (("ring_busbw", ">= 0.90 of the link at >= 16 MB", lambda v: min(v) >= 0.9),
                          ("model", "every algorithm within 10 % of its model at >= 1 MB",
                           lambda v: max(v) <= 0.10),
                          ("ab_model", "... of the plain alpha-beta model (ring fit)", lambda v: max(v) <= 0.10),
                          ("best_vs_gloo", "best >= gloo at >= 4 MB (gloo time / best time >= 1)",
                           lambda v: min(v) >= 1.0),
                          ("auto", "auto within 5 % of the best at every size", lambda v: max(v) <= 1.05)):
        v = out[key]
        if v:
            within = f" ({sum(x <= 0.10 for x in v)} of {len(v)} rows within 10 %)" if "model" in key else ""
            print(f"  {goal}: worst {min(v) if key in ('ring_busbw', 'best_vs_gloo') else max(v):.3f}"
                  f" -> {'met' if ok(v) else 'NOT met'}{within}")
    return out


def _bps(link: str) -> float:
    from disttrain.cluster.spec import parse_rate

    return parse_rate(link)


def _fmt(n: int) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--ppn", type=int, nargs="+", default=[1, 2])
    p.add_argument("--link", nargs="+", default=["1gbit"])
    p.add_argument("--sizes", nargs="+", default=["64K", "256K", "1M", "4M", "16M"])
    p.add_argument("--max-reps", type=int, default=5)
    p.add_argument("--algos", nargs="+", default=list(ALGOS), choices=ALGOS)
    p.add_argument("--topology", default="switch", choices=("switch", "full", "ring"))
    p.add_argument("--switch", help="switch capacity (switch topology only)")
    p.add_argument("--cpus-per-node", type=float, help="CPU quota per node (default: none)")
    p.add_argument("--json", help="also write every row here")
    p.add_argument("--report", nargs="+", metavar="JSON", help="measure nothing: fit and report the rows "
                   "of these --json files (e.g. after a change to the model)")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.inner:
        return inner(args)
    if args.report:
        rows = [r for path in args.report for r in json.load(open(path))["rows"]]
        report(rows)
        return None
    rows = measure(1, 2, args.link[0], args.sizes, args.max_reps, None, ["ring"])
    for link in args.link:
        for nodes in args.nodes:
            for ppn in args.ppn:
                t0 = time.time()
                rows += measure(nodes, ppn, link, args.sizes, args.max_reps, args.cpus_per_node,
                                args.algos, args.topology, args.switch)
                print(f"measured {nodes}x{ppn} at {link} in {time.time() - t0:.0f} s", file=sys.stderr)
    summary = report(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "targets": summary, "argv": sys.argv}, f, indent=1)


if __name__ == "__main__":
    main()
