"""The recommendation in words that `disttrain plan layout` prints under its table.

`recommend_layout` reads the planner's own result (plan/layout.py's `Plan`) and the ZeRO
formulas (plan/memory.py): whether the whole model's states fit one device, the least
sharding that would make them fit, the fastest layout that fits and the term where the
runner-up lost. Pure function over data; no torch.
"""

from __future__ import annotations

from dataclasses import replace

from disttrain.plan.cost import Estimate, estimate
from disttrain.plan.devices import Device
from disttrain.plan.gpt import GPTSpec
from disttrain.plan.memory import model_state_bytes

__all__ = ["recommend_layout", "loss_kind"]

_COMM = ("tp all-reduce", "pipeline p2p", "dp ", "ZeRO-3 gathers", "ZeRO parameter all-gather",
         "step barrier")


def loss_kind(name: str) -> str:
    """Which of the words the recommendation uses a time term's name belongs to."""
    if name.startswith("bubble"):
        return "bubble"
    if name.startswith(_COMM):
        return "exposed communication"
    return "compute"


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3g} GB" if nbytes < 1e12 else f"{nbytes / 1e9:,.0f} GB"


def _shape(lay) -> str:
    parts = [f"{k} {v}" for k, v in (("pp", lay.pp), ("tp", lay.tp), ("dp", lay.dp)) if v > 1]
    text = " x ".join(parts) or "one device"
    extra = [f"ZeRO-{lay.zero}"] if lay.zero else []
    extra += [f"micro-batch {lay.micro_batch}"]
    extra += [lay.schedule, f"m={lay.microbatches}"] if lay.pp > 1 else []
    extra += ["recompute"] if lay.recompute else []
    extra += ["SP"] if lay.sp else []
    return text + (f" ({', '.join(extra)})" if extra else "")


def _zero1(m: GPTSpec, dev: Device, nodes_of: int, win: Estimate | None) -> str:
    """What ZeRO-1 changes for the winner's data-parallel shape, priced by the cost model."""
    if win is None or win.layout.dp == 1:
        return ""
    plain, z1 = (estimate(m, replace(win.layout, zero=z), dev,
                          nodes_of) for z in (0, 1))
    saved, slower = plain.memory - z1.memory, z1.step - plain.step
    time = ("no step time" if abs(slower) < 5e-4 * plain.step else
            f"{'costs' if slower > 0 else 'saves'} {abs(slower):.3g} s per step")
    return f" (ZeRO-1 over dp {win.layout.dp} saves {saved / 1e9:.3g} GB per device, {time})"


def _states(m: GPTSpec, dev: Device, n: int, nodes_of: int, win: Estimate | None) -> str:
    """Whether the whole model's states fit one device, and if not the least split that would."""
    usable = dev.per_rank(n).usable_bytes
    full = model_state_bytes(m.params, 1, 0).total
    head = f"model states {_gb(full)}"
    if full <= usable:
        if win is not None and (win.layout.pp, win.layout.tp) != (1, 1):
            return f"{head} fit one {dev.key} device: data parallel would do for memory"
        return f"{head} fit one {dev.key} device: data parallel{_zero1(m, dev, nodes_of, win)}"
    ways = []
    z3 = next((k for k in range(2, n + 1) if model_state_bytes(m.params, k, 3).total <= usable), None)
    if z3:
        ways.append(f"ZeRO-3 over {z3} devices")
    tp = next((t for t in (2, 4, 8, 16, 32, 64) if t <= nodes_of and m.heads % t == 0
               and full / t <= usable), None)
    if tp:
        ways.append(f"tp {tp} inside a node")
    else:
        big = max(t for t in (1, 2, 4, 8, 16, 32, 64) if t <= nodes_of and m.heads % t == 0)
        pp = next((p for p in range(2, m.layers + 1) if m.layers % p == 0 and big * p <= n
                   and full / (big * p) <= usable), None)
        if pp:
            ways.append(f"tp {big} inside a node x pp {pp}" if big > 1 else f"pp {pp}")
    need = " or ".join(ways) or f"more than {n} devices of memory"
    return f"{head} do not fit one {dev.key} device ({_gb(usable)} usable): {need}"


def _rival(ranked: list[Estimate]) -> Estimate | None:
    """The fastest layout of another (pp, tp, dp) shape, else of another ZeRO stage, else the
    plain runner-up: the comparison that says most about why the winner won."""
    win = ranked[0].layout
    for fields in (("pp", "tp", "dp"), ("pp", "tp", "dp", "zero")):
        key = [getattr(win, f) for f in fields]
        other = [e for e in ranked[1:] if [getattr(e.layout, f) for f in fields] != key]
        if other:
            return other[0]
    return ranked[1] if len(ranked) > 1 else None


def _why(win: Estimate, rival: Estimate, what: str) -> str:
    """One clause: the kind of term (summed) where the rival lost the most time."""
    gaps: dict[str, float] = {}
    terms: dict[tuple[str, str], float] = {}
    for sign, e in ((1.0, rival), (-1.0, win)):
        for t in e.time:
            kind = loss_kind(t.name)
            if kind == "compute" and (rival.layout.recompute != win.layout.recompute):
                kind = "recompute time"
            gaps[kind] = gaps.get(kind, 0.0) + sign * t.value
            key = (kind, t.name.split(" (")[0])
            terms[key] = terms.get(key, 0.0) + sign * t.value
    if rival.step - win.step < 1e-6:
        return (f"{what} on memory ({win.memory / 1e9:.3g} GB vs {rival.memory / 1e9:.3g} GB "
                f"per device, the same step time)")
    kind, gap = max(gaps.items(), key=lambda kv: kv[1])
    _, term = max((v, k[1]) for k, v in terms.items() if k[0] == kind)
    most = "" if kind == "bubble" else f", most of it {term}"
    return (f"{what} ({rival.step:.4g} s, {rival.step - win.step:+.4g} s) on {kind}: "
            f"{gap:+.4g} s{most}")


def recommend_layout(m: GPTSpec, dev: Device, n: int, nodes_of: int, result,
                     data_parallel: Estimate | None = None) -> str:
    """The recommendation: memory verdict, the fastest layout that fits, why it won.

    `result` is plan_layouts' Plan; `data_parallel` the fastest pure data-parallel layout
    (pp = tp = 1) that fits, when the caller priced one: if it is not the winner, the
    recommendation says where it lost.
    """
    win = result.ranked[0] if result.ranked else None
    lines = [_states(m, dev, n, min(nodes_of, n), win)]
    if win is None:
        return f"recommendation: {lines[0]}."
    lines.append(f"the fastest layout that fits is {_shape(win.layout)}: step {win.step:.4g} s, "
                 f"{win.memory / 1e9:.3g} GB per device")
    rival = _rival(result.ranked)
    if rival is not None:
        lines.append(_why(win, rival, f"it beats {_shape(rival.layout)}"))
    flat = data_parallel
    if (flat is not None and (win.layout.pp, win.layout.tp) != (1, 1) and flat.step > win.step
            and (rival is None or rival.layout != flat.layout)):
        lines.append(_why(win, flat, f"pure data parallel ({_shape(flat.layout)}) loses"))
    return "recommendation: " + "; ".join(lines) + "."
