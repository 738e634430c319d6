"""Plan layout: rank every (pp, dp, tp, ZeRO, micro-batch, schedule, recompute, SP) layout.

`disttrain plan layout --model gpt:... --devices N --device a100-80gb` enumerates the
layouts disttrain can run for a GPT on N devices (nodes of `--nodes-of`), drops those
that do not fit the device's memory, prices the rest with plan/cost.py and prints them
fastest first; `--explain` prints the winner's terms with their formulas and sources,
and where the runner-up lost time. Branch and bound keeps it under a second: layouts
are visited by a cheap lower bound (no bubble, no data-parallel time) and the
simulator runs only while that bound can still beat the `--top`-th best.

Who talks to whom: cli.py -> plan/__init__.py's `add_plan_parser` -> `add_layout_parser`;
tests call `plan_layouts`. Pure Python over data: no process group, no torch.distributed.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace

from disttrain.parallel.pipeline.schedules import SCHEDULES
from disttrain.plan.calibrate import calibrate, calibrated_device
from disttrain.plan.cost import Estimate, Layout, estimate, lower_bound, memory
from disttrain.plan.devices import DEVICES, Device, device
from disttrain.plan.gpt import GPTSpec, parse_gpt
from disttrain.plan.layout_text import explain, table
from disttrain.plan.profiled import load_profile, profile_model
from disttrain.plan.recommend import recommend_layout

__all__ = ["Pins", "Plan", "candidates", "plan_layouts", "add_layout_parser"]

MICRO_BATCHES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Pins:
    """Layout fields the user fixed (None: the planner chooses)."""

    tp: int | None = None
    pp: int | None = None
    zero: int | None = None
    micro_batch: int | None = None
    schedule: str | None = None
    recompute: bool | None = None
    sp: bool | None = None


@dataclass
class Plan:
    """The ranked estimates (fastest first) and what happened to the other candidates."""

    ranked: list[Estimate]
    too_big: int
    """Candidates checked and found not to fit the device's memory."""
    visited: int
    """Candidates priced in full (simulated)."""
    candidates: int
    """All candidates; those neither priced nor too big were pruned by their lower bound."""
    smallest: tuple[float, Layout] | None = None
    """The least memory a candidate that did not fit needs, and that candidate."""


def _powers_of_two(limit: int) -> list[int]:
    return [1 << k for k in range(limit.bit_length()) if (1 << k) <= limit]


def candidates(m: GPTSpec, n: int, global_batch: int, pins: Pins = Pins()):
    """Every layout disttrain can run for `m` on `n` devices with `global_batch` sequences."""
    for tp in _powers_of_two(min(n, m.heads)):
        if m.heads % tp or n % tp or pins.tp not in (None, tp):
            continue
        for pp in (p for p in range(1, m.layers + 1) if m.layers % p == 0 and (n // tp) % p == 0):
            if pins.pp not in (None, pp):
                continue
            dp = n // (tp * pp)
            for b in (pins.micro_batch,) if pins.micro_batch else MICRO_BATCHES:
                if global_batch % (dp * b):
                    continue
                mb = global_batch // (dp * b)
                yield from _variants(m, tp, pp, dp, b, mb, pins)


def _variants(m: GPTSpec, tp: int, pp: int, dp: int, b: int, mb: int, pins: Pins):
    schedules = ["-"] if pp == 1 else [
        s for s in SCHEDULES
        if s != "interleaved" or (mb % pp == 0 and m.layers % (2 * pp) == 0)]
    for schedule in schedules:
        for zero in range(4) if dp > 1 else (0,):
            for recompute in (False, True):
                for sp in (False, True) if tp > 1 and m.seq % tp == 0 else (False,):
                    lay = Layout(pp, dp, tp, zero, b, mb, schedule, recompute, sp)
                    # NOTE: the runtime refuses these (zero.md, model-parallelism.md)
                    if (zero == 3 and sp) or (schedule == "zb-h1" and (recompute or zero == 3)):
                        continue
                    if _pinned(lay, pins):
                        yield lay


def _pinned(lay: Layout, pins: Pins) -> bool:
    return all(getattr(pins, f) in (None, getattr(lay, f))
               for f in ("zero", "schedule", "recompute", "sp"))


def plan_layouts(m: GPTSpec, dev: Device, n: int, nodes_of: int, global_batch: int,
                 pins: Pins = Pins(), top: int = 10) -> Plan:
    """The `top` fastest layouts that fit, by predicted step time (branch and bound)."""
    nodes_of = min(nodes_of, n)
    order = sorted(((lower_bound(m, lay, dev, nodes_of), i, lay)
                    for i, lay in enumerate(candidates(m, n, global_batch, pins))))
    ranked: list[Estimate] = []
    too_big = visited = 0
    smallest = None
    for bound, _, lay in order:
        if len(ranked) >= top and bound >= ranked[top - 1].step:
            break
        need = sum(t.value for t in memory(m, lay))
        if need > dev.per_rank(n).usable_bytes:
            too_big += 1
            smallest = min(smallest or (need, lay), (need, lay), key=lambda x: x[0])
            continue
        visited += 1
        ranked.append(estimate(m, lay, dev, nodes_of))
        ranked.sort(key=lambda e: (round(e.step, 6), e.memory))  # ties: the smaller footprint
    return Plan(ranked[:top], too_big, visited, len(order), smallest)


def add_layout_parser(sub) -> None:
    """Register `disttrain plan layout` on the `plan` command's subparsers."""
    p = sub.add_parser(
        "layout", help="rank pp x dp x tp x ZeRO layouts of a GPT by predicted step time",
        description="Predicted step time, MFU and memory of every layout (docs/design/plan.md).",
        epilog="example: disttrain plan layout --model gpt:layers=96,hidden=12288,heads=96,"
               "seq=2048,vocab=51200 --devices 1024 --device a100-80gb --global-batch 1536 "
               "--tokens 300e9")
    p.add_argument("--model", help="gpt:layers=L,hidden=H,heads=A,seq=S,vocab=V (default: "
                                   "the --profile's model)")
    p.add_argument("--profile", metavar="FILE",
                   help="layer seconds measured by `disttrain plan profile` in place of FLOPs")
    p.add_argument("--calibrate", metavar="DIR",
                   help="a traced run's measured compute and all-reduce times (`disttrain run "
                        "--trace DIR` of this model) in place of FLOPs and devices.json's link")
    p.add_argument("--devices", type=int, required=True, help="number of devices N")
    p.add_argument("--device", required=True, help=f"one of {', '.join(DEVICES)}")
    p.add_argument("--nodes-of", type=int, default=8, help="devices per node (default 8)")
    p.add_argument("--global-batch", type=int, help="sequences per step (default: N)")
    p.add_argument("--micro-batch", type=int, help="sequences per micro-batch (default: chosen)")
    p.add_argument("--tokens", type=float, help="training tokens: print the time as N days")
    p.add_argument("--explain", action="store_true", help="the winner's terms and sources")
    p.add_argument("--top", type=int, default=10, help="rows to print (default 10)")
    for name in ("tp", "pp", "zero"):
        p.add_argument(f"--{name}", type=int, help=f"fix {name} (default: chosen)")
    p.add_argument("--schedule", choices=list(SCHEDULES), help="fix the pipeline schedule")
    p.add_argument("--recompute", choices=("on", "off"), help="fix full activation recompute")
    p.add_argument("--sp", choices=("on", "off"), help="fix sequence parallelism")
    p.set_defaults(handler=_plan_layout)


def _check(args: argparse.Namespace) -> tuple[GPTSpec, Device, Pins]:
    m, dev = _model(args), device(args.device)
    if args.profile:
        if not dev.shared_machine:
            raise ValueError(f"--profile {args.profile} was measured on this machine's CPU; "
                             f"plan it with --device cpu-here (not {dev.key})")
        dev = replace(dev, profile=load_profile(args.profile, m))
    if args.calibrate:
        if args.profile or not dev.shared_machine:
            raise ValueError(f"--calibrate {args.calibrate} measured a run on this machine: plan it "
                             f"with --device cpu-here and without --profile (not {dev.key})")
        args.calibration = calibrate(args.calibrate, m)
        dev = calibrated_device(dev, m, args.calibration)
    for name in ("devices", "nodes_of", "global_batch", "micro_batch", "top", "tp", "pp"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.zero is not None and args.zero not in range(4):
        raise ValueError(f"--zero must be 0, 1, 2 or 3, got {args.zero}")
    if args.devices > args.nodes_of and args.devices % args.nodes_of:
        raise ValueError(f"--devices ({args.devices}) must be whole nodes: a multiple of "
                         f"--nodes-of ({args.nodes_of})")
    if args.tokens is not None and not args.tokens > 0:
        raise ValueError(f"--tokens must be > 0, got {args.tokens}")
    on = {None: None, "on": True, "off": False}
    pins = Pins(args.tp, args.pp, args.zero, args.micro_batch, args.schedule,
                on[args.recompute], on[args.sp])
    return m, dev, pins


def _model(args: argparse.Namespace) -> GPTSpec:
    """--model, or the GPT the --profile measured; a ValueError when neither says."""
    if args.model:
        return parse_gpt(args.model)
    m = profile_model(args.profile) if args.profile else None
    if m is None:
        raise ValueError("give --model gpt:layers=L,hidden=H,heads=A,seq=S,vocab=V" +
                         (f" (--profile {args.profile} does not name its model)"
                          if args.profile else ""))
    return m


def _plan_layout(args: argparse.Namespace) -> int:
    try:
        m, dev, pins = _check(args)
        batch = args.global_batch or args.devices
        result = plan_layouts(m, dev, args.devices, args.nodes_of, batch, pins, args.top)
        if not result.ranked:
            raise ValueError(_nothing_fits(args, dev, batch, result))
    except ValueError as err:
        print(f"disttrain plan layout: error: {err}", file=sys.stderr)
        return 2
    print(table(m, dev, args.devices, batch, result, args.tokens))
    print(recommend_layout(m, dev, args.devices, args.nodes_of, result,
                           _data_parallel(m, dev, args, batch, pins)))
    if args.explain:
        print(explain(m, dev, args.devices, batch, result))
        if args.calibrate:
            print("\n".join(args.calibration.lines()))
    return 0


def _data_parallel(m: GPTSpec, dev: Device, args: argparse.Namespace, batch: int,
                   pins: Pins) -> Estimate | None:
    """The fastest pure data-parallel layout (pp = tp = 1) that fits, unless pins rule it out."""
    if pins.tp not in (None, 1) or pins.pp not in (None, 1):
        return None
    flat = plan_layouts(m, dev, args.devices, args.nodes_of, batch, replace(pins, tp=1, pp=1), 1)
    return flat.ranked[0] if flat.ranked else None


def _nothing_fits(args: argparse.Namespace, dev: Device, batch: int, result: Plan) -> str:
    if not result.candidates:
        return (f"no layout of {args.devices} devices matches the fixed fields and divides "
                f"--global-batch {batch}; pick a global batch that is a multiple of dp x "
                f"micro-batch, or fix fewer of --tp/--pp/--zero/--schedule/--micro-batch "
                f"(--zero needs dp > 1, --schedule pp > 1)")
    need, lay = result.smallest
    return (f"no layout fits {args.devices} x {dev.key} ({dev.usable_bytes / 1e9:.3g} GB usable): the "
            f"smallest of {result.too_big} needs {need / 1e9:.3g} GB (pp={lay.pp} dp={lay.dp} "
            f"tp={lay.tp} zero={lay.zero} recompute={'on' if lay.recompute else 'off'}); add "
            f"devices, pick a larger device, or loosen --tp/--pp/--zero/--recompute/--sp")
