"""`disttrain plan layout --calibrate DIR`: a traced run's measured compute and communication
as the planner's inputs, in place of FLOP-derived and table-derived figures.

From DIR/trace.json and DIR/metrics.jsonl (`disttrain run --trace DIR`), over every
worker rank and the steps after the first (the first holds warm-up):

- compute: the median forward and backward seconds of one micro-batch (the "forward" /
  "backward" compute spans, or a pipeline's F / B / W spans, summed per micro-batch),
  split between the transformer blocks and the LM head by their FLOPs (24bsh^2 + 4bs^2h
  per block, 2bshV the head) into a `LayerProfile`, so cost.py's `layer_seconds` and
  `head_seconds` scale them by FLOPs exactly as a `--profile` file's; the micro-batch b
  is the step's logged tokens (`disttrain.log(tokens=...)`) / seq / micro-batches. The
  trace measured its W ranks sharing the machine, so the profile counts as W ranks' share
  (a layout of n > W ranks is n / W times slower per layer). The median optimizer.step
  span replaces the memory-bandwidth optimizer term (scaled by parameters per device).
- communication: the all-reduce spans' (bytes, seconds) fitted by least squares to the
  ring model comm/cost.py prices (2(n-1) steps of alpha + S/n / B, no CPU terms: the
  measure includes them) over each distinct message size's median; with one size (or a
  fit with a negative alpha) the device's link is kept and `--explain` says so. The
  fitted alpha and B replace
  the device's link inside a node (or across nodes when the trace's ranks ran on
  several nodes).

The measured step time (median of metrics.jsonl's step_time) comes back for `--explain`.
Standard library JSON only: no torch.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections import defaultdict
from dataclasses import dataclass, replace

from disttrain.plan.devices import Device
from disttrain.plan.gpt import GPTSpec
from disttrain.plan.profiled import LayerProfile

__all__ = ["Calibration", "calibrate", "calibrated_device"]


@dataclass(frozen=True)
class Calibration:
    """What the trace gave the planner, for the device and `--explain`."""

    directory: str
    world: int
    micro_batch: int
    microbatches: int
    fwd_s: float
    bwd_s: float
    optimizer_s: float | None
    alpha: float | None
    Bps: float | None
    comm_how: str
    step_s: float
    remote: bool

    def lines(self) -> list[str]:
        """`--explain`'s account of the inputs taken from the trace."""
        out = [f"calibrated from the trace {self.directory} ({self.world} ranks, steps after the first):",
               f"  compute: forward {self.fwd_s * 1e3:.4g} ms + backward {self.bwd_s * 1e3:.4g} ms "
               f"per micro-batch of {self.micro_batch} ({self.microbatches} per step), split "
               "blocks / LM head by FLOPs, in place of FLOPs at the device's rates"]
        if self.optimizer_s is not None:
            out.append(f"  optimizer step: {self.optimizer_s * 1e3:.4g} ms measured, in place of "
                       "30 B/param at memory bandwidth")
        if self.alpha is not None:
            where = "across nodes" if self.remote else "inside a node"
            out.append(f"  all-reduce {where}: alpha {self.alpha * 1e6:.4g} us, "
                       f"{self.Bps * 8 / 1e9:.4g} Gbit/s ({self.comm_how}), no CPU terms, in "
                       "place of devices.json's")
        else:
            out.append(f"  communication: {self.comm_how}; devices.json's link kept")
        out.append(f"  measured step time (median): {self.step_s * 1e3:.4g} ms")
        return out


def _read(directory: str) -> tuple[list[dict], dict, list[dict]]:
    path = os.path.join(directory, "trace.json")
    try:
        with open(path, encoding="utf-8") as fp:
            tr = json.load(fp)
        with open(os.path.join(directory, "metrics.jsonl"), encoding="utf-8") as fp:
            metrics = [json.loads(x) for x in fp if x.strip()]
    except OSError as err:
        raise ValueError(f"--calibrate {directory}: cannot read {err.filename} ({err.strerror}); "
                         "give the folder of `disttrain run --trace DIR`") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"--calibrate {directory}: not JSON ({err.msg}); merge the trace again") from None
    return tr.get("traceEvents", []), tr.get("otherData") or {}, metrics


def _kind(e: dict) -> str | None:
    cat, name = e.get("cat"), e.get("name", "")
    if cat == "compute":
        return {"forward": "F", "backward": "B", "optimizer.step": "O"}.get(name)
    if cat == "pipeline" and name[:1] in ("F", "B", "W"):
        return "B" if name[0] == "W" else name[0]
    return None


def _compute(events: list[dict], first: dict[int, float]) -> dict[str, list[float]]:
    """Per (rank, step) sums of F / B / O seconds and the count of F spans."""
    steps = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "step" and e["ts"] > first.get(e["pid"], math.inf):
            steps[e["pid"]].append((e["ts"], e["ts"] + e["dur"]))
    out: dict[str, list[float]] = defaultdict(list)
    sums: dict[tuple, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for e in events:
        k = _kind(e) if e.get("ph") == "X" else None
        if k is None:
            continue
        for i, (t0, t1) in enumerate(steps.get(e["pid"], [])):
            if t0 <= e["ts"] < t1:
                s = sums[(e["pid"], i)]
                s[k] += e["dur"] / 1e6
                s["n"] += k == "F"
    for s in sums.values():
        for k in ("F", "B", "O", "n"):
            if k in s:
                out[k].append(s[k])
    return out


def _fit(events: list[dict], n: int) -> tuple[float | None, float | None, str]:
    """(alpha, B, how) of the ring model 2(n-1)(alpha + S / (n B)) over the all-reduce spans."""
    by_size: dict[float, list[float]] = defaultdict(list)
    for e in events:
        a = e.get("args", {})
        if e.get("ph") == "X" and e.get("cat") == "comm" and e.get("name", "").startswith("all_reduce") \
                and a.get("bytes") and a.get("ranks") == n:
            by_size[float(a["bytes"])].append(e["dur"] / 1e6)
    if n < 2 or not by_size:
        return None, None, "no all-reduce over the traced ranks in the trace"
    pts = sorted((s, statistics.median(d)) for s, d in by_size.items())
    calls = sum(len(d) for d in by_size.values())
    if len(pts) >= 2:  # t = 2(n-1) alpha + 2(n-1)/n S / B: a line in S
        ms, mt = statistics.fmean(x for x, _ in pts), statistics.fmean(t for _, t in pts)
        slope = (sum((x - ms) * (t - mt) for x, t in pts) / sum((x - ms) ** 2 for x, _ in pts))
        alpha = (mt - slope * ms) / (2 * (n - 1))
        if slope > 0 and alpha >= 0:
            return alpha, 2 * (n - 1) / (n * slope), \
                f"least squares over {len(pts)} sizes' medians, {calls} calls"
    return None, None, f"one message size ({len(pts)} of {calls} calls) or a non-physical fit"


def calibrate(directory: str, m: GPTSpec) -> Calibration:
    """The measured inputs of the traced run in `directory` for planning `m` (see the module)."""
    events, other, metrics = _read(directory)
    workers = [p for p in other.get("processes", []) if p.get("role", "worker") == "worker"]
    world = len(workers) or 1
    first = {}
    for e in events:  # NOTE: the first recorded step of each rank holds warm-up: left out
        if e.get("ph") == "X" and e.get("cat") == "step":
            first[e["pid"]] = min(first.get(e["pid"], math.inf), e["ts"])
    got = _compute(events, first)
    if not got.get("F") or not got.get("B"):
        raise ValueError(f"--calibrate {directory}: the trace has no forward/backward spans after its "
                         "first step; trace at least 2 steps of a module with hooks (DataParallel, "
                         "Parallelism)")
    later = [x for x in metrics if x.get("step", 0) > min(y.get("step", 0) for y in metrics)]
    tokens = [x["tokens"] for x in later if x.get("tokens")]
    if not tokens:
        raise ValueError(f"--calibrate {directory}: metrics.jsonl has no tokens per step; log them in "
                         "the script (disttrain.log(tokens=x.numel())) and trace again")
    mb = max(1, round(statistics.median(got["n"])))
    b = statistics.median(tokens) / m.seq / mb
    if b < 1 or abs(b - round(b)) > 1e-6:
        raise ValueError(f"--calibrate {directory}: {statistics.median(tokens):g} tokens per step "
                         f"over {mb} micro-batches is not whole sequences of seq={m.seq}; give the "
                         "--model the run trained")
    remote = len({p.get("node") for p in workers if p.get("node") is not None}) > 1
    alpha, bps, how = _fit(events, world)
    return Calibration(directory, world, round(b), mb, statistics.median(got["F"]) / mb,
                       statistics.median(got["B"]) / mb,
                       statistics.median(got["O"]) if got.get("O") else None, alpha, bps, how,
                       statistics.median(x["step_time"] for x in later), remote)


def calibrated_device(dev: Device, m: GPTSpec, c: Calibration) -> Device:
    """`dev` with the trace's compute (a LayerProfile) and fitted link in place of its own."""
    b, s, h = c.micro_batch, m.seq, m.hidden
    block, head = 24 * b * s * h * h + 4 * b * s * s * h, 2 * b * s * h * m.vocab
    part = block / (m.layers * block + head)
    prof = LayerProfile(path=c.directory, block="traced blocks", blocks=m.layers,
                        fwd_s=c.fwd_s * part, bwd_s=c.bwd_s * part,
                        head_fwd_s=c.fwd_s * (1 - m.layers * part),
                        head_bwd_s=c.bwd_s * (1 - m.layers * part),
                        flops=block, head_flops=head, batch=b, threads=1, cpus=c.world,
                        optimizer_s=c.optimizer_s, optimizer_params=m.params, calibrated=True)
    out = replace(dev, profile=prof)
    if c.alpha is not None:
        keys = ("inter_alpha", "inter_Bps") if c.remote else ("intra_alpha", "intra_Bps")
        fitted = f"fitted from {c.directory}/trace.json's all-reduces ({c.comm_how}; --calibrate)"
        out = replace(out, **dict(zip(keys, (c.alpha, c.Bps))), step_alpha=0.0,
                      cpu_Bps=math.inf, cpu_local_Bps=math.inf,
                      sources={**dev.sources, keys[0][:5]: fitted,
                               "cpu": "no CPU terms: the traced all-reduce times include them"})
    return out
