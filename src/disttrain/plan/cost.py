"""The cost of one layout: step time, memory per device and bytes per step, term by term.

A layout is (pp, dp, tp, ZeRO stage, micro-batch, schedule, recompute, sequence
parallel) of a GPT (plan/gpt.py) on a device of plan/devices.json. Every number is a
`Term` carrying its formula, inputs and source, so `--explain` can print it:

- compute: matmul FLOPs at the device's achieved matmul rate, elementwise bytes at its
  achieved memory bandwidth (datasheet x a measured copy fraction); backward twice forward, full recompute one more forward;
- tensor parallel: the collectives of the layer (not overlapped, as the runtime issues
  them inline), priced by comm/cost.py's ring model; pipeline sends as one p2p message
  per micro-batch, added to the receiving action;
- bubble: the pipeline schedule simulator (parallel/pipeline/schedules.py) run on the
  per-action durations, so the bubble is the simulator's, stage imbalance included;
- data parallel / ZeRO 0-2: gradient buckets (25 MB, the runtime's default) become
  ready evenly over the last micro-batch's backward and go out one after another;
  what is still on the wire when that backward ends is exposed. ZeRO 1-2 then
  all-gather the parameters after the step (exposed); ZeRO 3 gathers each layer once
  forward and once backward per micro-batch and reduce-scatters it, prefetching the
  next layer, so only max(0, comm - compute) per layer is exposed;
- memory: plan/memory.py's ZeRO formulas plus the activations the schedule keeps in
  flight (`peak_in_flight` of stage 0) times Korthikanti's bytes per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from disttrain.comm.cost import MODELLED, Links, collective_bound, predict, predict_collective
from disttrain.parallel.pipeline.schedules import (
    SCHEDULE_TABLE,
    peak_in_flight,
    peak_until_w,
    simulate,
)
from disttrain.plan.compute import head_seconds, layer_seconds, optimizer_seconds
from disttrain.plan.devices import Device
from disttrain.plan.gpt import KORTHIKANTI, GPTSpec, layer_cost
from disttrain.plan.memory import model_state_bytes
from disttrain.plan.terms import DTYPE, UNITS, Term, time_terms, wire_terms

__all__ = ["DTYPE", "Layout", "Term", "Estimate", "estimate", "memory", "lower_bound",
           "action_times", "layer_seconds", "BUCKET_BYTES", "UNITS", "blocking_extra"]

BUCKET_BYTES = 25 * 2 ** 20
"""DataParallel's and Zero's default bucket_mb=25."""

WIRE_BYTES = {"bf16": 2, "fp32": 4}
"""Bytes per element on the wire, per `Layout.precision`."""


@dataclass(frozen=True)
class Layout:
    """One candidate: how N devices split the model and the batch."""

    pp: int
    dp: int
    tp: int
    zero: int
    micro_batch: int
    microbatches: int
    schedule: str
    """"1f1b", "gpipe", "interleaved" (2 chunks per stage), "zb-h1"; "-" when pp == 1."""
    recompute: bool
    sp: bool
    precision: str = "bf16"
    """Elements on the wire: "bf16" (mixed precision) or "fp32" (a plain fp32 job)."""
    algorithm: str = "ring"
    """The dp all-reduce (ZeRO 0): a comm/cost.py MODELLED one, or "native" (as the ring)."""

    def __post_init__(self):
        if self.precision not in WIRE_BYTES:
            raise ValueError(f"precision {self.precision!r}: give one of {', '.join(WIRE_BYTES)}")
        if self.algorithm not in ("native", *MODELLED):
            raise ValueError(f"algorithm {self.algorithm!r}: give native or one of {', '.join(MODELLED)}")

    @property
    def virtual(self) -> int:
        return 2 if self.schedule == "interleaved" else 1

    @property
    def wire(self) -> int:
        return WIRE_BYTES[self.precision]


@dataclass
class Estimate:
    """A layout's predicted step: time terms, memory terms, totals."""

    layout: Layout
    step: float = 0.0
    bubble: float = 0.0
    memory: float = 0.0
    fits: bool = True
    wire_bytes: float = 0.0
    """Bytes one device sends per step (ring counts: all-reduce 2(n-1)/n S, halves (n-1)/n S)."""
    wire: list[Term] = field(default_factory=list)
    time: list[Term] = field(default_factory=list)
    mem: list[Term] = field(default_factory=list)


@lru_cache(maxsize=4096)
def _collective(op: str, nbytes: float, world: int, local: int, links: Links) -> float:
    return predict_collective(op, nbytes, world, local, links) if world > 1 else 0.0


@lru_cache(maxsize=256)
def _schedule(name: str, pp: int, m: int, v: int):
    # NOTE: the builders' lists are checked by tests/unit/test_schedules.py; make_schedule's
    # check (a full simulation) would double the planner's time
    return SCHEDULE_TABLE[name](pp, m, v)


@lru_cache(maxsize=256)
def _held(name: str, pp: int, m: int, v: int) -> int:
    """Micro-batch chunks stage 0 holds activations for (from the schedule's own lists)."""
    first = _schedule(name, pp, m, v)[0]
    return peak_until_w(first) if name == "zb-h1" else peak_in_flight(first)


def _group_local(size: int, stride: int, nodes_of: int) -> int:
    """Members of one group (ranks `stride` apart) that share a node."""
    return max(1, min(size, nodes_of // stride)) if stride < nodes_of else 1


def _per_layer(m: GPTSpec, lay: Layout, dev: Device, nodes_of: int) -> dict:
    """Seconds of one layer's forward / backward on one micro-batch, with their parts."""
    c = layer_cost(m, lay.micro_batch, lay.tp, lay.sp)
    f, b, w = layer_seconds(c, dev)
    local = _group_local(lay.tp, 1, nodes_of)
    tp_bytes = c.tp_bytes * lay.wire / 2  # NOTE: LayerCost counts 2-byte activations
    blocking = blocking_extra(dev)
    extra = blocking if lay.tp > 1 else 0.0
    ar = _collective("all-reduce", tp_bytes, lay.tp, local, dev.links(nics=local)) + extra
    tp_f = 2 * ar  # 2 all-reduces (SP: 2 all-gathers + 2 reduce-scatters, the same bytes)
    tp_b = (3 if lay.sp else 2) * ar  # SP re-gathers the column inputs: 4 AG + 2 RS
    fwd = f + tp_f
    bwd = b + tp_b + (fwd if lay.recompute else 0.0)
    bound = collective_bound("all-reduce", tp_bytes, lay.tp, local,
                             dev.links(nics=local))[0] if lay.tp > 1 else ""
    return {"f": f, "b": b, "w": w, "ar": ar, "extra": extra, "blocking": blocking, "tp_f": tp_f, "tp_b": tp_b, "fwd": fwd, "bwd": bwd,
            "cost": c, "tp_local": local, "tp_bound": bound, "tp_bytes": tp_bytes}


def blocking_extra(dev: Device) -> float:
    """Seconds one blocking collective adds beyond the link model when ranks compute around
    it: the measured pair all-reduce (`plan profile --ranks`, plan/profile_sync.py) minus
    this model's price of it; 0 without that measurement (and on GPUs)."""
    p = dev.profile
    if p is None or p.inline is None:
        return 0.0
    nbytes, seconds = p.inline
    return max(0.0, seconds - _collective("all-reduce", nbytes, 2, 2, dev.links()))


def _stage_params(m: GPTSpec, lay: Layout) -> float:
    """Parameters one device of the first stage holds (its layers and the embedding)."""
    return (m.layers // lay.pp * m.layer_params + m.embed_params) / lay.tp


def lower_bound(m: GPTSpec, lay: Layout, dev: Device, nodes_of: int) -> float:
    """A cheap lower bound of `estimate(...).step` (no simulation), for branch and bound.

    The last stage is busy m (F + B + head + its sends and receives), cannot start before
    its first input crossed the p - 1 chunks before it, and its last backward's gradient
    still crosses them after it (not under ZB-H1); exposed data-parallel time and the optimizer add.
    """
    dev = dev.per_rank(lay.pp * lay.dp * lay.tp)
    per = _per_layer(m, lay, dev, nodes_of)
    d = _durations(m, lay, dev, nodes_of, per)
    v, mb = lay.virtual, lay.microbatches
    last = mb * (v * (d["F"] + d["B"]) + d["head_f"] + d["head_b"])
    if lay.pp > 1:  # NOTE: its v forwards each receive, v - 1 of its backwards send; after
        # its last backward that chunk's gradient still crosses the p - 1 stages before it
        # (ZB-H1: not counted, the last stage's W's may run meanwhile)
        drain = 0.0 if lay.schedule == "zb-h1" else d["B"]
        last += (lay.pp - 1) * (d["F"] + drain) + mb * (2 * v - 1) * d["p2p"]
    dp = _data_parallel(m, lay, dev, nodes_of, d["B"] * v)
    return last + dp["reduce"] + dp["gather"] + optimizer_seconds(_stage_params(m, lay) / (lay.dp if lay.zero else 1), dev)


def _durations(m: GPTSpec, lay: Layout, dev: Device, nodes_of: int, per: dict) -> dict:
    """Seconds of each pipeline action kind, per layer chunk, plus the pieces for --explain."""
    b, s, h, t = lay.micro_batch, m.seq, m.hidden, lay.tp
    head_f, head_b = head_seconds(m, b, t, dev)
    # NOTE: tp > 1 (models/gpt.py's tp_plan): the vocab-parallel embedding all-reduces its
    # output, the column-parallel head its input's gradient, the vocab-parallel loss two
    # per-token fp32 values (max; sum of exp with the target logit); SP halves the first two
    half = per["ar"] / 2 if lay.sp else per["ar"]
    loss = sum(_collective("all-reduce", k * 4 * b * s, t, per["tp_local"],
                           dev.links(nics=per["tp_local"])) + per["extra"] for k in (1, 2)) if t > 1 else 0.0
    emb_f, head_f, head_b = half, head_f + loss, head_b + half
    act = lay.wire * b * s * h / (t if lay.sp else 1)
    remote = lay.dp * lay.tp >= nodes_of  # NOTE: pp is the outermost mesh axis
    p2p = (_collective("p2p", act, 2, 1 if remote else 2, dev.links()) + per["blocking"]
           if lay.pp > 1 else 0.0)
    z3_f = z3_b = z3_first = 0.0
    if lay.zero == 3:
        unit = lay.wire * m.layer_params / t
        local = _group_local(lay.dp, t, nodes_of)
        ag = _collective("all-gather", unit, lay.dp, local, dev.links(nics=local))
        rs = _collective("reduce-scatter", unit, lay.dp, local, dev.links(nics=local))
        if dev.profile is not None and dev.profile.full:
            # NOTE: ranks fill the cores: the prefetched gather's CPU work cannot run beside
            # the compute, so every unit's gather (UNITS per layer) is a blocking collective
            units = UNITS * _collective("all-gather", unit / UNITS, lay.dp, local, dev.links(nics=local))
            x = UNITS * per["blocking"]
            z3_f, z3_b, z3_first = units + x, units + rs + x, 0.0
        else:
            z3_f, z3_b, z3_first = max(0.0, ag - per["fwd"]), max(0.0, ag + rs - per["bwd"]), ag
    lc = m.layers // (lay.pp * lay.virtual)
    # NOTE: autograd accumulates each micro-batch's weight gradients into .grad (read it
    # and the new gradient, write it: 6 B/param in bf16) unless ZeRO-3 reduce-scatters them
    acc = 0.0 if lay.zero == 3 else 3 * lay.wire * m.layer_params / t / dev.memory_Bps
    fwd = lc * (per["fwd"] + z3_f) + z3_first
    bwd = lc * (per["bwd"] + z3_b + acc) + z3_first
    w = lc * (per["w"] + acc)  # ZB-H1's W: the weight-gradient matmuls and their accumulation
    return {"F": fwd, "B": bwd, "W": w, "B_split": bwd - w, "emb_f": emb_f, "head_comm": half + loss,
            "p2p": p2p, "head_f": head_f, "head_b": head_b,
            "z3_f": z3_f, "z3_b": z3_b, "z3_first": z3_first, "p2p_bytes": act, "lc": lc,
            "acc": acc}


def action_times(m: GPTSpec, lay: Layout, dev: Device, nodes_of: int) -> dict:
    """Seconds of one chunk's "F", "B" (whole backward), "B_split" and "W" (ZB-H1's halves),
    one pipeline send "p2p", and the LM head's "head_f" / "head_b" on the last stage:
    what the simulator is given for each action."""
    dev = dev.per_rank(lay.pp * lay.dp * lay.tp)
    return _durations(m, lay, dev, nodes_of, _per_layer(m, lay, dev, nodes_of))


def _pipeline(lay: Layout, d: dict) -> tuple[float, float]:
    """(makespan, bubble) of one step's micro-batches: the simulator on these durations."""
    if lay.pp == 1:
        busy = lay.microbatches * (d["F"] + d["B"] + d["head_f"] + d["head_b"] + d["emb_f"])
        return busy, 0.0
    keys = ("F", "B", "W", "B_split", "p2p", "head_f", "head_b", "emb_f")
    return _simulated(lay.schedule, lay.pp, lay.microbatches, lay.virtual,
                      tuple(float(f"{d[k]:.9g}") for k in keys))


@lru_cache(maxsize=1024)
def _simulated(name: str, p: int, mb: int, v: int, times: tuple) -> tuple[float, float]:
    d = dict(zip(("F", "B", "W", "B_split", "p2p", "head_f", "head_b", "emb_f"), times))
    sched = _schedule(name, p, mb, v)
    last, split = p * v - 1, name == "zb-h1"
    durations = []
    for stage, actions in enumerate(sched):
        row = []
        for a in actions:
            j = a.chunk * p + stage
            if a.kind == "F":
                row.append(d["F"] + (d["p2p"] if j > 0 else d["emb_f"]) + (d["head_f"] if j == last else 0.0))
            elif a.kind == "W":
                row.append(d["W"])
            else:
                row.append((d["B_split"] if split else d["B"]) + (d["p2p"] if j < last else 0.0)
                           + (d["head_b"] if j == last else 0.0))
        durations.append(row)
    sim = simulate(sched, p, v, durations=durations)
    busy = max(sum(row) for row in durations)
    return sim.makespan, sim.makespan - busy


def _data_parallel(m: GPTSpec, lay: Layout, dev: Device, nodes_of: int, window: float) -> dict:
    """Exposed seconds of the gradient reduction and ZeRO's parameter gather, per step."""
    params = _stage_params(m, lay)
    grads = lay.wire * params  # bf16 (or fp32) gradients
    local = _group_local(lay.dp, lay.tp, nodes_of)
    links = dev.links(nics=local)
    out = {"grads": grads, "buckets": 0, "bucket": 0.0, "reduce": 0.0, "gather": 0.0, "bound": "", "times": 1}
    if lay.dp == 1 or lay.zero == 3:
        return out
    k = math.ceil(grads / BUCKET_BYTES)
    op = "all-reduce" if lay.zero == 0 else "reduce-scatter"
    algo = lay.algorithm if op == "all-reduce" and lay.algorithm != "native" else "ring"
    c = (_collective(op, grads / k, lay.dp, local, links) if algo == "ring"
         else predict(algo, grads / k, lay.dp, local, links)) + blocking_extra(dev)
    # NOTE: bucket i is ready at window * i / k and buckets go out one at a time, so the
    # last finishes at max(window / k + k c, window + c): the exposed part is that - window.
    # DataParallel syncs the last micro-batch only (no_sync); Zero 1-2 has no no_sync and
    # reduce-scatters every micro-batch's backward (parallel/zero/flat.py)
    times = lay.microbatches if lay.zero else 1
    out.update(buckets=k, bucket=c, reduce=times * max(window / k + k * c - window, c), times=times,
               bound=collective_bound(op, grads / k, lay.dp, local, links, algo)[0])
    if lay.zero in (1, 2):
        out["gather"] = _collective("all-gather", grads, lay.dp, local, links) + blocking_extra(dev)
    return out


def _memory(m: GPTSpec, lay: Layout) -> list[Term]:
    """Bytes on one device of the first stage (the one holding the most activations)."""
    c = layer_cost(m, lay.micro_batch, lay.tp, lay.sp)
    params = _stage_params(m, lay)
    states = model_state_bytes(params, lay.dp, lay.zero, "adam", "mixed")
    zero = ("plain DP", "ZeRO-1", "ZeRO-2", "ZeRO-3")[lay.zero]
    terms = [Term("model states", states.total,
                  f"{zero} over dp={lay.dp} of {params:.4g} params (16 B/param mixed Adam)",
                  "plan/memory.py (Rajbhandari et al. 2019, sec. 5)")]
    if lay.pp == 1:
        held, what = 1, "micro-batch (pp=1)"
    elif lay.schedule == "zb-h1":
        held = _held(lay.schedule, lay.pp, lay.microbatches, lay.virtual)
        what = "micro-batches between F and W on stage 0 (schedule lists)"
    else:
        held = _held(lay.schedule, lay.pp, lay.microbatches, lay.virtual)
        what = "micro-batch chunks in flight on stage 0 (schedule lists)"
    lc = m.layers // (lay.pp * lay.virtual)
    per = c.input_bytes if lay.recompute else c.activation_bytes
    kind = "2sbh layer inputs (full recompute)" if lay.recompute else (
        "34sbh/t + 5as^2b/t (sequence parallel)" if lay.sp else "sbh(10 + 24/t) + 5as^2b/t")
    terms.append(Term("activations", held * lc * per,
                      f"{held} {what} x {lc} layers x {per / 1e6:.4g} MB ({kind})", KORTHIKANTI))
    if lay.recompute:
        terms.append(Term("recompute working set", c.activation_bytes,
                          "one layer's full activations, rebuilt during its backward", KORTHIKANTI))
    if lay.zero == 3:
        terms.append(Term("gathered layers", 2 * 2 * 2 * m.layer_params / lay.tp,
                          "current + prefetched layer, bf16 parameters and gradients",
                          "parallel/zero/stage3.py (prefetch of the next unit)"))
    return terms


def memory(m: GPTSpec, lay: Layout) -> list[Term]:
    """The memory terms of one device of `lay`'s first stage (bytes)."""
    return _memory(m, lay)


def estimate(m: GPTSpec, lay: Layout, dev: Device, nodes_of: int) -> Estimate:
    """The predicted step of `lay` (see the module docstring for the model)."""
    dev = dev.per_rank(lay.pp * lay.dp * lay.tp)
    per = _per_layer(m, lay, dev, nodes_of)
    d = _durations(m, lay, dev, nodes_of, per)
    makespan, bubble = _pipeline(lay, d)
    window = d["B"] * lay.virtual
    dp = _data_parallel(m, lay, dev, nodes_of, window)
    opt = optimizer_seconds(_stage_params(m, lay) / (lay.dp if lay.zero else 1), dev)
    est = Estimate(lay, step=makespan + dp["reduce"] + dp["gather"] + opt, bubble=bubble)
    est.time = time_terms(m, lay, dev, per, d, dp, makespan, bubble, opt)
    est.mem = _memory(m, lay)
    est.memory = sum(t.value for t in est.mem)
    est.fits = est.memory <= dev.usable_bytes
    est.wire = wire_terms(m, lay, per, d, dp)
    est.wire_bytes = sum(t.value for t in est.wire)
    return est
