"""The `disttrain plan ps` command: reads flags, runs plan/ps.py, prints; bad input exits 2.

    disttrain plan ps --workers 4 --mode kbatch-sync --k 3 --compute exp:mean=0.05
    disttrain plan ps --workers 4 --compute exp:mean=0.05 --updates-to-target sync=96,ksync:2=97
"""

from __future__ import annotations

import argparse
import sys

from disttrain.cluster.spec import parse_rate
from disttrain.comm.cost import Links
from disttrain.plan.ps import (
    KASYNC_NOTE,
    MODES,
    Mode,
    closed_form,
    mode_name,
    parse_mode,
    recommend,
)
from disttrain.plan.simulate import BUDGET, Compute, Network, Result, simulate
from disttrain.ps.straggler import parse_straggler

__all__ = ["add_ps_parser"]

_ROWS = 8  # staleness rows printed before the rest is summed into one


def add_ps_parser(sub) -> None:
    """Register `disttrain plan ps` on the `plan` command's subparsers."""
    p = sub.add_parser(
        "ps", help="parameter-server modes: simulated time per update and staleness",
        description="Simulate a parameter-server job (the servers' own policies, seeded "
                    "straggler compute, links, apply time): time per update, updates/s and "
                    "the staleness of applied gradients.",
        epilog="example: disttrain plan ps --workers 4 --mode ksync --k 2 --compute "
               "exp:mean=1 --explain   (closed form (H_4 - H_2) x 1 s = 0.583 s)")
    p.add_argument("--workers", type=int, required=True, help="workers P")
    p.add_argument("--mode", help=f"one of {', '.join(MODES)} (or give --updates-to-target)")
    p.add_argument("--k", type=int, help="K of ksync, kbatch-sync, kasync, kbatch-async")
    p.add_argument("--s", type=int, help="SSP's staleness bound s")
    p.add_argument("--backups", type=int, help="backup workers b of mode backup (K-sync, K = P - b)")
    p.add_argument("--compute", required=True,
                   help="a worker step's delay model, seeded: exp:mean=1, "
                        "shifted-exp:shift=0.02,mean=0.05, fixed:rank=2,delay=0.2, none")
    p.add_argument("--base", type=float, default=0.0, help="seconds every step takes on top")
    p.add_argument("--cores", type=float, help="cores the workers' --base compute shares "
                   "(processes on one machine; default: a core each)")
    p.add_argument("--background", type=float, default=0.0,
                   help="with --cores: other processes always runnable on them")
    p.add_argument("--wake", type=float, default=0.0,
                   help="seconds every straggler sleep overruns (waking on a loaded machine)")
    p.add_argument("--servers", type=int, default=1, help="servers S (each gets 1/S of the bytes)")
    p.add_argument("--link", help="rate of every worker's and server's link, e.g. 1gbit "
                                  "(default: communication takes no time)")
    p.add_argument("--latency-us", type=float, help="alpha per message, microseconds "
                                                    f"(default {Links().alpha * 1e6:g} with --link)")
    p.add_argument("--bytes", type=float, default=0.0, help="bytes of one gradient push (= a pull)")
    p.add_argument("--apply", type=float, default=0.0, help="server seconds per update")
    p.add_argument("--updates", type=int, help="updates to simulate (default: about "
                   f"{BUDGET:,} worker computations' worth, 2,000 to 100,000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--updates-to-target", metavar="MODE=N,...",
                   help="updates each mode needs to reach a target (benchmarks/"
                        "ps_convergence.py), e.g. sync=300,kbatch-sync:3=420: recommend one")
    p.add_argument("--explain", action="store_true",
                   help="print the inputs and the closed form beside the simulated value")
    p.set_defaults(handler=_plan_ps)


def _inputs(args: argparse.Namespace) -> tuple[Compute, Network | None]:
    if args.workers is None or args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    if args.servers < 1:
        raise ValueError(f"--servers must be >= 1, got {args.servers}")
    if args.background and args.cores is None:
        raise ValueError("--background needs --cores N (the cores it shares)")
    compute = Compute(parse_straggler(args.compute, args.seed), args.base, args.cores,
                      args.background, args.wake)
    s = compute.straggler
    if not (compute.base or s.mean or s.shift or (s.kind == "fixed" and s.fixed)):
        raise ValueError(f"--compute {args.compute} with --base {args.base:g}: every step takes "
                         "0 s; give a delay model with a mean (exp:mean=0.05) or --base SECONDS")
    if args.link is None:
        if args.bytes or args.latency_us is not None:
            raise ValueError("--bytes and --latency-us need --link RATE (e.g. --link 1gbit)")
        return compute, None
    alpha = Links().alpha if args.latency_us is None else args.latency_us * 1e-6
    if alpha < 0:
        raise ValueError(f"--latency-us must be >= 0, got {args.latency_us}")
    return compute, Network(Links(alpha=alpha, link_Bps=parse_rate(args.link) / 8), args.bytes)


def _mode(args: argparse.Namespace) -> Mode:
    if args.mode is None:
        raise ValueError("give --mode M (one of " + ", ".join(MODES) + ") or --updates-to-target")
    name = mode_name(args.mode)
    need = MODES[name][0]
    given = {"k": args.k, "s": args.s, "backups": args.backups}
    extra = [f"--{n}" for n, v in given.items() if v is not None and n != need]
    if extra:
        raise ValueError(f"mode {name} takes no {' '.join(extra)}")
    mode = Mode(name, given[need] if need else None)
    mode.check(args.workers)
    return mode


def _needs(text: str) -> dict[Mode, int]:
    out = {}
    for item in filter(None, (i.strip() for i in text.split(","))):
        mode, eq, n = item.rpartition("=")
        if not eq or not n.strip().isdigit():
            raise ValueError(f"--updates-to-target: {item!r} is not MODE=N (e.g. kbatch-sync:3=420)")
        out[parse_mode(mode)] = int(n)
    return out


def _staleness(r: Result) -> list[str]:
    total = sum(r.staleness.values())
    lines = [f"staleness of applied gradients (server 0, {r.updates} updates, mean "
             f"{r.mean_staleness:.2f}):", f"{'staleness':>11}{'gradients':>11}{'share':>9}"]
    keys = sorted(r.staleness)
    for k in keys[:_ROWS]:
        lines.append(f"{k:>11}{r.staleness[k]:>11}{r.staleness[k] / total:>9.1%}")
    if len(keys) > _ROWS:
        rest = sum(r.staleness[k] for k in keys[_ROWS:])
        lines.append(f"{'>= ' + str(keys[_ROWS]):>11}{rest:>11}{rest / total:>9.1%}")
    return lines


def _explain(args, mode: Mode, compute: Compute, network: Network | None, r: Result) -> list[str]:
    comm = "none (Dutta et al.'s assumption)" if network is None else (
        f"links of {args.link} each way, alpha {network.links.alpha * 1e6:g} us, "
        f"{network.grad_bytes / args.servers:.4g} B per push or pull per server: "
        f"{network.busy(network.grad_bytes / args.servers) * 1e3:.4g} ms on the wire")
    lines = [f"inputs: {args.workers} workers, {args.servers} server(s), policy {r.policy}, "
             f"compute {args.base:g} s + {args.compute} (seed {args.seed}), "
             + ("" if args.cores is None else f"the {args.base:g} s shared on {args.cores:g} "
                f"cores with {args.background:g} other runnable processes, ")
             + (f"every sleep {args.wake:g} s longer, " if args.wake else "")
             + f"server apply {args.apply:g} s per update",
             f"communication: {comm}",
             f"simulated: {r.updates} updates after {r.warmup} of warm-up, standard "
             f"error {r.stderr:.2%} (20 batch means); {r.computations} computations, "
             f"{r.cancelled} cancelled, {r.dropped} late pushes dropped"]
    form = closed_form(mode, args.workers, compute, network, args.apply)
    if form is not None:
        value, text = form
        lines.append(f"closed form (Dutta et al. 2018, exponential compute, no communication): "
                     f"{text} = {value:.6g} s; simulated {r.time_per_update:.6g} s "
                     f"({r.time_per_update / value - 1:+.2%})")
    elif mode.name == "kasync":
        lines.append(KASYNC_NOTE)
    else:
        lines.append("closed form: none for these inputs (Dutta et al.'s hold for exponential "
                     "compute without base, communication or apply time; none for SSP)")
    return lines


def _plan_ps(args: argparse.Namespace) -> int:
    try:
        compute, network = _inputs(args)
        sim = dict(servers=args.servers, network=network, apply_s=args.apply,
                   updates=args.updates, seed=args.seed)
        if args.updates_to_target:
            if args.mode:
                raise ValueError("give --mode or --updates-to-target, not both")
            ranked, sentence = recommend(_needs(args.updates_to_target), args.workers, compute, **sim)
            print(f"{'mode':<28}{'s per update':>14}{'updates':>9}{'time to target':>16}")
            for c in ranked:
                print(f"{c.mode.label:<28}{c.result.time_per_update:>14.4g}"
                      f"{c.updates_to_target:>9}{c.seconds:>14.4g} s")
            print(sentence)
            return 0
        mode = _mode(args)
        r = simulate(lambda: mode.build(args.workers), args.workers, compute, **sim)
    except ValueError as err:
        print(f"disttrain plan ps: error: {err}", file=sys.stderr)
        return 2
    print(f"{mode.label}: {args.workers} workers, {args.servers} server(s), compute {args.compute}")
    print(f"mean time per update: {r.time_per_update:.4g} s")
    print(f"updates/s: {r.updates_per_s:.4g}")
    print("\n".join(_staleness(r)))
    if args.explain:
        print("\n".join(_explain(args, mode, compute, network, r)))
    return 0
