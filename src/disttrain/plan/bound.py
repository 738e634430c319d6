"""What bound each traced collective: latency, link bandwidth or the CPU pool (`disttrain report`).

The verdict is comm/cost.py's `collective_bound` (one model in one place) over the cost
inputs the trace recorded (trace.json's otherData: `link_gbps`, each process's `cost`
header from trace/recorder.py's `cost_meta`: ranks per node, the machine's CPUs, the
emulated node's CPU quota, any DISTTRAIN_* model number). What the trace lacks comes from
cpu-here's fit in plan/devices.json (this machine's emulated-cluster fit) and is named in
`inputs_note`. The fit was made with the whole machine's cores as the CPU pool; a node
quota of q cores on M nodes scales the pool's rates by M q / CPUs and the per-sender CPU
time by the inverse. The trace package cannot import comm (comm imports trace): cli.py
hands `verdict` to the report. Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.comm.cost import Links, collective_bound
from disttrain.plan.devices import device

__all__ = ["TraceLinks", "trace_links", "verdict", "model_op", "judge", "sentence"]

FIT = "cpu-here"
"""The device whose fitted numbers stand in for what a trace does not record."""

_OPS = {"all_reduce": "all-reduce", "reduce_scatter": "reduce-scatter", "all_gather": "all-gather",
        "send": "p2p", "recv": "p2p", "isend": "p2p", "irecv": "p2p"}


@dataclass(frozen=True)
class TraceLinks:
    """The model's links for one trace, its ranks per node and where each input came from."""

    links: Links
    local: int | None
    recorded: tuple[str, ...]
    defaulted: tuple[str, ...]

    def note(self) -> str:
        """One sentence naming the recorded inputs and the defaults used."""
        got = ", ".join(self.recorded) or "nothing"
        miss = f"; from {FIT}'s fit (plan/devices.json): {', '.join(self.defaulted)}" if self.defaulted else ""
        return f"cost inputs recorded in the trace: {got}{miss}"


def model_op(name: str) -> tuple[str, str] | None:
    """A traced collective's name ('all_reduce[tree]', 'all_gather_into_tensor') -> (the
    model's collective, its algorithm); gloo's own all_reduce is modelled as the ring."""
    base, _, algo = name.partition("[")
    algo = algo.rstrip("]") or "native"
    for prefix, op in _OPS.items():
        if base.startswith(prefix):
            return op, ("ring" if algo in ("native", "auto") else algo)
    return None


def trace_links(other: dict) -> TraceLinks:
    """The Links a trace's otherData implies, with the recorded and defaulted inputs named."""
    procs = other.get("processes", [])
    cost = next((p["cost"] for p in procs if p.get("cost")), {})
    fit = device(FIT)
    rec, miss = [], []

    def pick(key: str, label: str, fitted: float, scale=lambda v: v):
        if key in cost:
            rec.append(label)
            return scale(cost[key])
        miss.append(label)
        return fitted

    nodes = len({p["node"] for p in procs if p.get("node") is not None}) or 1
    pool = 1.0
    if "node_cpus" in cost and cost.get("cpus"):
        rec.append(f"CPU quota {cost['node_cpus']:g} cores per node of {cost['cpus']} CPUs")
        pool = min(1.0, nodes * cost["node_cpus"] / cost["cpus"])
    link = other.get("link_gbps")
    (rec if link else miss).append("link rate")
    links = Links(
        alpha=pick("alpha_us", "alpha", fit.inter_alpha, lambda v: v * 1e-6),
        link_Bps=link * 1e9 / 8 if link else fit.inter_Bps,
        local_alpha=pick("local_alpha_us", "local alpha", fit.intra_alpha, lambda v: v * 1e-6),
        local_Bps=pick("local_gbps", "local rate", fit.intra_Bps, lambda v: v * 1e9 / 8),
        step_alpha=pick("step_us", "per-sender CPU time", fit.step_alpha / pool, lambda v: v * 1e-6),
        cpu_Bps=pick("cpu_gbps", "CPU pool rate", fit.cpu_Bps * pool, lambda v: v * 1e9 / 8),
        cpu_local_Bps=pick("cpu_local_gbps", "local CPU pool rate", fit.cpu_local_Bps * pool,
                           lambda v: v * 1e9 / 8),
        shared_cpu=pick("shared_cpu", "shared CPU pool", fit.shared_cpu),
    )
    local = cost.get("local_ranks")
    (rec if local else miss).append("ranks per node")
    return TraceLinks(links, local, tuple(rec), tuple(miss))


def verdict(row: dict, tl: TraceLinks) -> dict | None:
    """{"bound", "predicted_us", "parts_us", "algorithm"} of one row of trace/commstats.py's
    `collectives` table under `tl`'s links, or None for what the model does not price."""
    op = model_op(row["op"])
    n = int(row["n"])
    if op is None or n < 2:
        return None
    local = n if row.get("crosses_nodes") is not True else min(n, tl.local or 1)
    if n % local:
        local = 1
    what, seconds, parts = collective_bound(op[0], float(row["bytes"]), n, local, tl.links, op[1])
    return {"bound": what, "predicted_us": 1e6 * seconds, "algorithm": op[1],
            "parts_us": {k: 1e6 * v for k, v in parts.items()}}


def judge(rows: list[dict], other: dict) -> tuple[list[dict | None], str]:
    """`verdict` of every row of a trace's collectives table, and `TraceLinks.note`."""
    tl = trace_links(other)
    return [verdict(r, tl) for r in rows], tl.note()


def sentence(row: dict, v: dict) -> str:
    """One diagnosis line: what bound this collective, with the model's parts and the measure."""
    p = v["parts_us"]
    return (f"{row['op']} of {row['bytes'] / 1e6:.2f} MB over {row['n']} ranks is {v['bound']}-bound "
            f"in the cost model ({v['algorithm']}: latency {p['latency'] / 1e3:.2f} ms, link "
            f"{p['bandwidth'] / 1e3:.2f} ms, CPU pool {p['cpu'] / 1e3:.2f} ms; predicted "
            f"{v['predicted_us'] / 1e3:.2f} ms, measured median {row['median_us'] / 1e3:.2f} ms)")
