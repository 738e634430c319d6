"""PNG plots of the emulated-cluster benchmarks, measured beside the alpha-beta model.

    python benchmarks/plot_cluster.py --allreduce ar.json --ps ps.json \
        --scaling gpt_1gbit.json gpt_10gbit.json --alpha-us A --fit-gbps B --out docs

Reads the --json files of benchmarks/allreduce.py and benchmarks/scaling.py and writes
allreduce_busbw.png (bus bandwidth per algorithm and size, one panel per cluster, the
model dashed), ps_vs_ring.png (step time measured and predicted) and scaling_efficiency.png
(weak-scaling efficiency against nodes, measured and predicted).
"""

from __future__ import annotations

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"native": "black", "ring": "tab:blue", "halving-doubling": "tab:orange",
          "tree": "tab:green", "hierarchical": "tab:red"}


def allreduce(path: str, out: str) -> str:
    rows = [r for r in json.load(open(path))["rows"] if r["nodes"] > 1]
    panels = sorted({(r["link"], r["nodes"], r["ppn"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6), squeeze=False)
    for ax, (link, nodes, ppn) in zip(axes[0], panels):
        for algo, color in COLORS.items():
            mine = sorted((r for r in rows if (r["link"], r["nodes"], r["ppn"], r["algo"]) ==
                           (link, nodes, ppn, algo)), key=lambda r: r["bytes"])
            if not mine:
                continue
            mb = [r["bytes"] / 2**20 for r in mine]
            ax.plot(mb, [r["busbw"] for r in mine], "o-", color=color,
                    label="gloo" if algo == "native" else algo)
            if "model" in mine[0]:
                n = nodes * ppn
                ax.plot(mb, [2 * (n - 1) / n * r["bytes"] * 8 / 1e9 / r["model"] for r in mine],
                        "--", color=color, alpha=0.6)
        ax.set(xscale="log", xlabel="message MB", ylabel="bus bandwidth Gbit/s",
               title=f"{nodes} nodes x {ppn}, {link} (dashed: model)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    return _save(fig, out, "allreduce_busbw.png")


def ps(path: str, out: str) -> str:
    rows = json.load(open(path))
    names = [f"PS S={r['servers']}" if r["servers"] else "ring" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    ax.bar([i - 0.2 for i in x], [r["step_s"] * 1e3 for r in rows], 0.4, label="measured")
    ax.bar([i + 0.2 for i in x], [r["model_s"] * 1e3 for r in rows], 0.4, label="alpha-beta model")
    ax.set_xticks(list(x), names)
    ax.set(ylabel="step ms", title="parameter servers vs ring allreduce, 4 workers")
    ax.legend()
    return _save(fig, out, "ps_vs_ring.png")


def scaling(paths: list[str], out: str, args) -> str:
    from scaling import predicted_step  # benchmarks/scaling.py: the same model as its table

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for path in paths:
        rows = json.load(open(path))
        base = rows[0]
        for r in rows:
            r.setdefault("model_s", predicted_step(base["step_s"], r["grad_bytes"], r["nodes"],
                                                   r["ppn"], args))
        nodes = [r["nodes"] for r in rows]
        eff = [r["samples_s"] / (base["samples_s"] * r["world"] / base["world"]) for r in rows]
        label = os.path.basename(path).removesuffix(".json")
        line = ax.plot(nodes, eff, "o-", label=f"{label} measured")[0]
        ax.plot(nodes, [base["step_s"] / r["model_s"] for r in rows], "--",
                color=line.get_color(), label=f"{label} model")
    ax.set(xscale="log", xlabel="nodes (one rank each)", ylabel="efficiency vs 1 node",
           title="data-parallel weak scaling", ylim=(0, 1.1))
    ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
    ax.minorticks_off()
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out, "scaling_efficiency.png")


def _save(fig, out: str, name: str) -> str:
    os.makedirs(out, exist_ok=True)
    fig.tight_layout()
    path = os.path.join(out, name)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--allreduce")
    p.add_argument("--ps")
    p.add_argument("--scaling", nargs="+")
    p.add_argument("--alpha-us", type=float, default=1700.0, help="scaling model: alpha (as scaling.py)")
    p.add_argument("--fit-gbps", type=float, default=0.92, help="scaling model: B (as scaling.py)")
    p.add_argument("--out", default="docs")
    args = p.parse_args()
    done = ([allreduce(args.allreduce, args.out)] if args.allreduce else []) + \
        ([ps(args.ps, args.out)] if args.ps else []) + \
        ([scaling(args.scaling, args.out, args)] if args.scaling else [])
    print("\n".join(done))


if __name__ == "__main__":
    main()
