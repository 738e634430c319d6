"""The terms of plan/cost.py's estimate: each number with its formula and source.

`time_terms` lists the busiest stage's work (matmul, elementwise, gradient
accumulation, LM head, tensor-parallel collectives, pipeline sends), the simulator's
bubble and the exposed data-parallel / ZeRO communication; `wire_bytes` counts what one
device sends per step. `--explain` prints them (plan/layout_text.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.plan.gpt import KORTHIKANTI, NARAYANAN, GPTSpec

UNITS = 6
"""Modules with parameters in one GPT block (2 LayerNorms, QKV, attention output, MLP in
and out: models/gpt.py, as Megatron's): ZeRO-3 gathers each as one unit."""

__all__ = ["Term", "time_terms", "wire_terms"]

DTYPE = "bf16"
"""Mixed precision: bf16 matmuls, fp32 master weights and Adam (plan/memory.py's "mixed")."""


@dataclass(frozen=True)
class Term:
    """One number of the estimate with where it comes from."""

    name: str
    value: float
    """Seconds (time terms) or bytes (memory terms)."""
    formula: str
    source: str = ""


def wire_terms(m: GPTSpec, lay, per: dict, d: dict, dp: dict) -> list[Term]:
    """Bytes one device sends per step, per kind (ring counts; `lay` is a cost.Layout)."""
    t, n, mb = lay.tp, lay.dp, lay.microbatches
    layers = m.layers // lay.pp
    count = 2 + (3 if lay.sp else 2) + (2 if lay.recompute else 0)
    s = per["tp_bytes"]
    out = [Term("tp collectives", count * 2 * (t - 1) / t * s * layers * mb,
                f"{count} all-reduces' worth x 2(t-1)/t x {s / 1e6:.4g} MB x {layers} layers x "
                f"{mb} micro-batches")] if t > 1 else []
    if lay.pp > 1:
        out.append(Term("pipeline sends", 2 * d["p2p_bytes"] * mb,
                        f"2 x {mb} x {d['p2p_bytes'] / 1e6:.4g} MB"))
    g = dp["grads"]
    dtype = "bf16" if lay.wire == 2 else "fp32"
    what = {0: "all-reduce 2(n-1)/n", 1: f"reduce-scatter per micro-batch x {mb} + all-gather, (n-1)/n",
            2: f"reduce-scatter per micro-batch x {mb} + all-gather, (n-1)/n",
            3: f"3(n-1)/n per micro-batch x {mb}"}
    if n > 1:
        out.append(Term("data parallel", {0: 2, 1: mb + 1, 2: mb + 1, 3: 3 * mb}[lay.zero] * g * (n - 1) / n,
                        f"{what[lay.zero]} x {g / 1e6:.4g} MB of {dtype} gradients, n = dp = {n}"))
    return out


def _share_how(p) -> str:
    if p.alternating:
        return ("measured: compute between blocking pair all-reduces with that many ranks, "
                "plan profile --ranks")
    if p.share_measured and p.at_once is not None:
        return (f"{p.at_once:.3g} of {p.ranks} ranks computing at once on average, the others "
                "waiting in the bubble: linear between the slowdowns measured with that many "
                "copies of the profile at once, plan profile --ranks")
    if p.share_measured:
        return "measured: that many copies of the profile at once, plan profile --ranks"
    return "ranks x threads over CPUs"


def _compute_terms(lay, dev, per, count: int, passes: int) -> list[Term]:
    """The layers' compute: matmul and elementwise terms, or the profiled block's seconds."""
    c, p = per["cost"], dev.profile
    recompute = " + recompute 1" if lay.recompute else ""
    if p is not None:
        total = count * (per["f"] + per["b"] + (per["f"] if lay.recompute else 0.0))
        if p.calibrated:
            return [Term("layer compute (traced)", total,
                         f"{count} layer passes x (fwd {per['f'] * 1e3:.4g} + bwd {per['b'] * 1e3:.4g}"
                         f"{recompute and ' + fwd again'} ms): the traced micro-batch's forward / "
                         f"backward at batch {p.batch}, the blocks' FLOP share, x b/{p.batch}/t"
                         f"{f' x {p.share:.3g} (ranks over the traced {p.cpus})' if p.share > 1 else ''}",
                         f"measured: {p.path}/trace.json (--calibrate)")]
        return [Term("layer compute (profiled)", total,
                     f"{count} layer passes x (fwd {per['f'] * 1e3:.4g} + bwd {per['b'] * 1e3:.4g}"
                     f"{recompute and ' + fwd again'} ms): the profiled {p.block}'s median "
                     f"{p.fwd_s * 1e3:.4g} / {p.bwd_s * 1e3:.4g} ms at batch {p.batch} on "
                     f"{p.threads} of {p.cpus} CPUs x b/{p.batch}/t"
                     f"{f' x {p.share:.3g} ({_share_how(p)})' if p.share > 1 else ''}",
                     f"measured: {p.path} (disttrain plan profile)")]
    mm, el = per["w"], per["f"] - per["w"]
    rate = f"{dev.matmul_flops(DTYPE) / 1e12:.4g} TFLOP/s"
    src = f"{dev.sources.get('peak')}; {dev.sources.get('matmul')}"
    return [
        Term("matmul", count * passes * mm,
             f"{count} layer passes x {passes} x (24bsh^2 + 4bs^2h)/t = "
             f"{c.matmul_flops:.4g} FLOP at {rate}", f"{NARAYANAN}; {src}"),
        Term("elementwise", count * passes * el,
             f"{count} layer passes x (fwd 1 + bwd 2{recompute}) x "
             f"{c.elementwise_bytes / 1e6:.4g} MB at {dev.memory_Bps / 1e9:.4g} GB/s",
             f"{KORTHIKANTI} (tensor list); {dev.sources.get('hbm')} x "
             f"{dev.hbm_efficiency:.3g}: {dev.sources.get('hbm_efficiency')}")]


def _parallel_terms(lay, dev, per, d, mb: int, layers: int, bubble: float) -> list[Term]:
    """The tensor-parallel collectives, the pipeline's sends and its bubble."""
    out = []
    if lay.tp > 1:
        where = "intra" if per["tp_local"] == lay.tp else "inter"
        n = (per["tp_f"] + per["tp_b"] + (per["tp_f"] if lay.recompute else 0)) / per["ar"]
        out.append(Term("tp all-reduce" + (" (SP: all-gather/reduce-scatter)" if lay.sp else ""),
                        mb * layers * n * per["ar"],
                        f"{mb} x {layers} layers x {n:g} x ring all-reduce of {lay.wire}bsh = "
                        f"{per['tp_bytes'] / 1e6:.4g} MB over tp={lay.tp} ({per['ar'] * 1e3:.3g} ms each, "
                        f"{per['tp_bound']}-bound"
                        + (f"; {per['extra'] * 1e3:.3g} ms of it measured per blocking collective "
                           + ("as the call's wall in a loop alternating compute and it"
                              if dev.profile is not None and dev.profile.alternating
                              else "between computing ranks") if per["extra"] else "") + ")",
                        f"comm/cost.py ring; {dev.sources.get(where)}"))
    if lay.tp > 1:
        out.append(Term("tp embedding, LM head and loss", mb * (d["emb_f"] + d["head_comm"]),
                        f"{mb} x (the vocab-parallel embedding's and the head's all-reduce of "
                        f"{per['tp_bytes'] / 1e6:.4g} MB{', halved by SP' if lay.sp else ''}; the "
                        f"vocab-parallel loss's 2 of 4bs and 8bs bytes): first and last stage",
                        "models/gpt.py tp_plan; comm/cost.py ring"))
    if lay.pp > 1:
        out.append(Term("pipeline p2p", 2 * mb * d["p2p"],
                        f"2 x {mb} sends of {d['p2p_bytes'] / 1e6:.4g} MB ({d['p2p'] * 1e3:.3g} ms each)",
                        f"comm/cost.py p2p; {dev.sources.get('inter')}"))
        out.append(Term(f"bubble ({lay.schedule}, pp={lay.pp}, m={mb})", bubble,
                        "makespan - busiest stage's busy time, from the schedule simulator",
                        "parallel/pipeline/schedules.py simulate()"))
    return out


def time_terms(m, lay, dev, per, d, dp, makespan, bubble, opt) -> list[Term]:
    """The step's time terms (seconds), each with formula and source, for `--explain`.
    Terms of different stages both appear (the LM head and the embedding's collectives)."""
    mb, layers, lc = lay.microbatches, m.layers // lay.pp, d["lc"]
    passes = 4 if lay.recompute else 3
    out = _compute_terms(lay, dev, per, mb * layers, passes) + [
        Term("gradient accumulation", mb * layers * d["acc"],
             f"{mb} x {layers} layers x {3 * lay.wire} B/param x {m.layer_params / lay.tp:.4g} params "
             f"at {dev.memory_Bps / 1e9:.4g} GB/s (AccumulateGrad into {lay.precision} .grad)",
             dev.sources.get("hbm", "")),
        Term("LM head (last stage)", mb * (d["head_f"] + d["head_b"] - d["head_comm"]),
             f"{mb} x " + ("the profiled head's fwd + bwd x b/(profiled b)/t" if dev.profile
                           else "3 x 2bshV/t FLOP + fp32 logits"),
             (f"measured: {dev.profile.path}" + ("/trace.json (--calibrate)" if dev.profile.calibrated
                                                  else "")) if dev.profile else NARAYANAN),
    ]
    out += _parallel_terms(lay, dev, per, d, mb, layers, bubble)
    if lay.zero == 3:
        out.append(Term("ZeRO-3 gathers (exposed)", mb * (lc * lay.virtual) * (d["z3_f"] + d["z3_b"])
                        + mb * lay.virtual * (d["z3_first"] + d["z3_first_b"]),
                        (f"the ranks fill the cores: every unit's gather blocks, and in the backward "
                         f"its reduce-scatter ({UNITS} units per layer, each collective + "
                         f"{per['blocking'] * 1e3:.3g} ms measured per blocking collective); the "
                         "embeddings', final LayerNorm's and head's units each pass alike"
                         if dev.profile is not None and dev.profile.full else
                         "per layer max(0, all-gather [+ reduce-scatter] - compute), prefetching "
                         "the next layer; the first layer's gather exposed"),
                        "comm/cost.py ring; parallel/zero/stage3.py; plan profile --ranks"))
    if dp["buckets"]:
        op = "all-reduce" if lay.zero == 0 else "reduce-scatter"
        if lay.zero == 0 and lay.algorithm not in ("ring", "native"):
            op += f" [{lay.algorithm}]"
        out.append(Term(f"dp {op} (exposed)", dp["reduce"],
                        f"{dp['buckets']} buckets of {dp['grads'] / dp['buckets'] / 1e6:.3g} MB, "
                        f"{dp['bucket'] * 1e3:.3g} ms each ({dp['bound']}-bound), ready over "
                        + ("the last backward: " if dp["times"] == 1 else
                           f"each of {dp['times']} micro-batches' backward: {dp['times']} x ")
                        + "max(window/k + k c - window, c)", "comm/cost.py ring; data-parallel.md"))
    if dp["gather"]:
        out.append(Term("ZeRO parameter all-gather", dp["gather"],
                        f"all-gather of {dp['grads'] / 1e6:.4g} MB {lay.precision} parameters after the step",
                        "zero.md (Stages 0-2)"))
    p = dev.profile
    if p is not None and p.optimizer_s is not None:
        how = "traced optimizer.step" if p.calibrated else "profiled AdamW step"
        out.append(Term(f"optimizer step ({'traced' if p.calibrated else 'profiled'})", opt,
                        f"the {how} {p.optimizer_s * 1e3:.4g} ms at {p.optimizer_params:.4g} "
                        f"params, scaled by this shard's params"
                        f"{f' x {p.share:.3g} ({_share_how(p)})' if p.share > 1 else ''}",
                        f"measured: {p.path}" + ("/trace.json (--calibrate)" if p.calibrated
                                                 else " (disttrain plan profile)")))
    else:
        out.append(Term("optimizer step", opt, "30 B/param of Adam's shard at memory bandwidth",
                        dev.sources.get("hbm", "")))
    return out
