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
- the step's own barrier and loss collectives (plan/per_step.py);
- ranks of one machine (`cpu-here`, a `--ranks` profile): compute at the measured
  slowdown and each blocking collective at the measured extra; ranks that block after
  every piece of compute (tp > 1, ZeRO-3 on full cores) as the alternating loop measured
  them (`rank_device`);
- memory: plan/layout_memory.py (plan/memory.py's ZeRO formulas plus the activations the
  schedule keeps in flight times Korthikanti's bytes per layer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

from disttrain.comm.cost import Links, collective_bound, predict, predict_collective
from disttrain.parallel.pipeline.schedules import simulate
from disttrain.plan.compute import head_seconds, layer_seconds, optimizer_seconds
from disttrain.plan.devices import Device
from disttrain.plan.gpt import GPTSpec, layer_cost
from disttrain.plan.layout_memory import (
    Layout,
    memory,
    memory_terms,
    schedule_actions,
    stage_params,
)
from disttrain.plan.per_step import step_collectives
from disttrain.plan.terms import DTYPE, UNITS, Term, time_terms, wire_terms

__all__ = ["DTYPE", "Layout", "Term", "Estimate", "estimate", "memory", "lower_bound",
           "action_times", "layer_seconds", "BUCKET_BYTES", "UNITS", "blocking_extra",
           "rank_device", "ENDS"]

ENDS = 4
"""Modules with parameters outside the blocks (models/gpt.py: wte, wpe, ln_f, lm_head):
ZeRO-3 gathers each as one unit, every forward and backward (4 of 28 units per pass in a
traced 4-layer dp 2 job)."""

BUCKET_BYTES = 25 * 2 ** 20
"""DataParallel's and Zero's default bucket_mb=25."""

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


def rank_device(lay: Layout, dev: Device) -> Device:
    """What one rank of `lay` gets (`Device.per_rank`); on a machine its ranks share, with
    a `--ranks` profile: when its ranks block on a collective after every piece of compute
    (tp > 1, or ZeRO-3's unit gathers with the cores full), compute and each blocking
    collective as the loop that alternates them measured (`LayerProfile.alternate`)."""
    dev = dev.per_rank(lay.pp * lay.dp * lay.tp)
    p = dev.profile
    if p is not None and (lay.tp > 1 or (lay.zero == 3 and p.full)):
        dev = replace(dev, profile=p.alternate())
    return dev


def blocking_extra(dev: Device) -> float:
    """Seconds one blocking collective adds beyond the link model when ranks compute around
    it: the measured pair all-reduce (`plan profile --ranks`, plan/profile_sync.py) minus
    this model's price of it; 0 without that measurement (and on GPUs)."""
    p = dev.profile
    if p is None or p.inline is None:
        return 0.0
    nbytes, seconds = p.inline
    return max(0.0, seconds - _collective("all-reduce", nbytes, 2, 2, dev.links()))


def lower_bound(m: GPTSpec, lay: Layout, dev: Device, nodes_of: int) -> float:
    """A cheap lower bound of `estimate(...).step` (no simulation), for branch and bound.

    The last stage is busy m (F + B + head + its sends and receives), cannot start before
    its first input crossed the p - 1 chunks before it, and its last backward's gradient
    still crosses them after it (not under ZB-H1); exposed data-parallel time and the optimizer add.
    """
    dev = rank_device(lay, dev)
    if lay.pp > 1 and dev.profile is not None:  # NOTE: estimate's eased share is >= 1 copy's
        dev = replace(dev, profile=dev.profile.computing(0.0))
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
    return (last + dp["reduce"] + dp["gather"] + _per_step(lay, dev, nodes_of)[0]
            + optimizer_seconds(stage_params(m, lay) / (lay.dp if lay.zero else 1), dev))


def _per_step(lay: Layout, dev: Device, nodes_of: int) -> tuple[float, str]:
    """The step's barrier and loss collectives (plan/per_step.py) over this layout's groups."""
    pp_local = _group_local(lay.pp, lay.dp * lay.tp, nodes_of)
    dp_local = _group_local(lay.dp, lay.tp, nodes_of)

    def price(op: str, nbytes: float, world: int, local: int) -> float:
        return _collective(op, nbytes, world, local, dev.links(nics=local))

    return step_collectives(lay.pp, lay.dp, pp_local, dp_local, blocking_extra(dev), price)


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
    z3_f = z3_b = z3_first = z3_first_b = 0.0
    if lay.zero == 3:
        unit = lay.wire * m.layer_params / t
        local = _group_local(lay.dp, t, nodes_of)
        links = dev.links(nics=local)

        def coll(op: str, nbytes: float) -> float:
            return _collective(op, nbytes, lay.dp, local, links)

        if dev.profile is not None and dev.profile.full:
            # NOTE: ranks fill the cores: the prefetched gather's CPU work cannot run beside
            # the compute, so every unit's gather (UNITS per layer) is a blocking collective,
            # and so is every unit's reduce-scatter in the backward (stage3.py issues one per
            # unit as its gradient is ready: 56 per step of dp2 zero3 in a trace, 2 x 28)
            blocking = per["blocking"]
            units = UNITS * (coll("all-gather", unit / UNITS) + blocking)
            unit_rs = UNITS * (coll("reduce-scatter", unit / UNITS) + blocking)
            # NOTE: so do the ends' units, ENDS per pass (models/gpt.py: token and position
            # embeddings on the first stage, final LayerNorm and head on the last), here
            # sharing the embeddings' (V + s)h parameters; chunks are priced alike, so with
            # pp > 2 a middle stage is charged two of them too
            ends = ENDS if lay.pp == 1 else ENDS // 2
            end_bytes = lay.wire * m.embed_params / t / ends
            end = coll("all-gather", end_bytes) + blocking
            end_rs = coll("reduce-scatter", end_bytes) + blocking
            z3_f, z3_b, z3_first, z3_first_b = units, units + unit_rs, ends * end, ends * (end + end_rs)
        else:
            ag, rs = coll("all-gather", unit), coll("reduce-scatter", unit)
            z3_f, z3_b, z3_first = max(0.0, ag - per["fwd"]), max(0.0, ag + rs - per["bwd"]), ag
            z3_first_b = z3_first
    lc = m.layers // (lay.pp * lay.virtual)
    # NOTE: autograd accumulates each micro-batch's weight gradients into .grad (read it
    # and the new gradient, write it: 6 B/param in bf16) unless ZeRO-3 reduce-scatters them
    acc = 0.0 if lay.zero == 3 else 3 * lay.wire * m.layer_params / t / dev.memory_Bps
    fwd = lc * (per["fwd"] + z3_f) + z3_first
    bwd = lc * (per["bwd"] + z3_b + acc) + z3_first_b
    w = lc * (per["w"] + acc)  # ZB-H1's W: the weight-gradient matmuls and their accumulation
    return {"F": fwd, "B": bwd, "W": w, "B_split": bwd - w, "emb_f": emb_f, "head_comm": half + loss,
            "p2p": p2p, "head_f": head_f, "head_b": head_b,
            "z3_f": z3_f, "z3_b": z3_b, "z3_first": z3_first, "z3_first_b": z3_first_b, "p2p_bytes": act, "lc": lc,
            "acc": acc}


def action_times(m: GPTSpec, lay: Layout, dev: Device, nodes_of: int) -> dict:
    """Seconds of one chunk's "F", "B" (whole backward), "B_split" and "W" (ZB-H1's halves),
    one pipeline send "p2p", and the LM head's "head_f" / "head_b" on the last stage:
    what the simulator is given for each action."""
    dev = rank_device(lay, dev)
    return _durations(m, lay, dev, nodes_of, _per_layer(m, lay, dev, nodes_of))


def _pipeline(lay: Layout, d: dict) -> tuple[float, float]:
    """(makespan, bubble) of one step's micro-batches: the simulator on these durations."""
    if lay.pp == 1:
        busy = lay.microbatches * (d["F"] + d["B"] + d["head_f"] + d["head_b"] + d["emb_f"])
        return busy, 0.0
    keys = ("F", "B", "W", "B_split", "p2p", "head_f", "head_b", "emb_f")
    # NOTE: which W walk the whole graph again (split_backward.py): ZeRO 1-2's every W,
    # DataParallel's synced one (each chunk's last W on its stage)
    return _simulated(lay.schedule, lay.pp, lay.microbatches, lay.virtual,
                      tuple(float(f"{d[k]:.9g}") for k in keys),
                      lay.zero in (1, 2), lay.dp > 1 and lay.zero == 0)


@lru_cache(maxsize=1024)
def _simulated(name: str, p: int, mb: int, v: int, times: tuple, whole_w: bool = False,
               synced_w: bool = False) -> tuple[float, float]:
    """ZB-H1 as runtime.py / split_backward.py run it: B computes the input's gradient and
    W the weights' along their own branches, except where W walks the whole graph again
    (a whole backward: `whole_w` every W, `synced_w` each chunk's last W on its stage), and
    on the first virtual stage, whose input (token ids) needs no gradient: there B does
    nothing and every W is the whole backward."""
    d = dict(zip(("F", "B", "W", "B_split", "p2p", "head_f", "head_b", "emb_f"), times))
    sched = schedule_actions(name, p, mb, v)
    last, split = p * v - 1, name == "zb-h1"
    durations = []
    for stage, actions in enumerate(sched):
        synced = {a.chunk: i for i, a in enumerate(actions) if a.kind == "W"}
        row = []
        for i, a in enumerate(actions):
            j = a.chunk * p + stage
            if a.kind == "F":
                row.append(d["F"] + (d["p2p"] if j > 0 else d["emb_f"]) + (d["head_f"] if j == last else 0.0))
            elif a.kind == "W":
                whole = j == 0 or whole_w or (synced_w and synced[a.chunk] == i)
                row.append(d["B"] if whole else d["W"])
            else:
                own = (0.0 if j == 0 else d["B_split"]) if split else d["B"]
                row.append(own + (d["p2p"] if j < last else 0.0) + (d["head_b"] if j == last else 0.0))
        durations.append(row)
    sim = simulate(sched, p, v, durations=durations)
    busy = max(sum(row) for row in durations)
    return sim.makespan, sim.makespan - busy


def _data_parallel(m: GPTSpec, lay: Layout, dev: Device, nodes_of: int, window: float) -> dict:
    """Exposed seconds of the gradient reduction and ZeRO's parameter gather, per step."""
    params = stage_params(m, lay)
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


def estimate(m: GPTSpec, lay: Layout, dev: Device, nodes_of: int) -> Estimate:
    """The predicted step of `lay` (see the module docstring for the model).

    With pp > 1 on a machine its ranks share, priced twice: a stage waiting in its bubble
    leaves its core, so the second pricing takes the slowdown of as many ranks as compute
    at once on average (N x the busy share of the first; `LayerProfile.computing`).
    """
    dev = rank_device(lay, dev)
    est = _estimate(m, lay, dev, nodes_of)
    if lay.pp > 1 and dev.profile is not None and est.step > 0:
        eased = dev.profile.computing((est.step - est.bubble) / est.step)
        if eased is not dev.profile:
            est = _estimate(m, lay, replace(dev, profile=eased), nodes_of)
    return est


def _estimate(m: GPTSpec, lay: Layout, dev: Device, nodes_of: int) -> Estimate:
    per = _per_layer(m, lay, dev, nodes_of)
    d = _durations(m, lay, dev, nodes_of, per)
    makespan, bubble = _pipeline(lay, d)
    window = d["B"] * lay.virtual
    dp = _data_parallel(m, lay, dev, nodes_of, window)
    opt = optimizer_seconds(stage_params(m, lay) / (lay.dp if lay.zero else 1), dev)
    fixed, how = _per_step(lay, dev, nodes_of)
    est = Estimate(lay, step=makespan + dp["reduce"] + dp["gather"] + opt + fixed, bubble=bubble)
    est.time = time_terms(m, lay, dev, per, d, dp, makespan, bubble, opt)
    if fixed:
        est.time.append(Term("step barrier and loss", fixed, how,
                             "parallel/pipeline/runtime.py Pipeline.step; parallel/parallel_model.py "
                             "train_step; comm/cost.py ring"))
    est.mem = memory_terms(m, lay)
    est.memory = sum(t.value for t in est.mem)
    est.fits = est.memory <= dev.usable_bytes
    est.wire = wire_terms(m, lay, per, d, dp)
    est.wire_bytes = sum(t.value for t in est.wire)
    return est
