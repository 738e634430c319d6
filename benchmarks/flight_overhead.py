"""Benchmark: what the flight recorder adds to a collective (disttrain.comm vs torch.distributed).

One spawned gloo job of `--world` ranks. Each round times `--calls` back-to-back
all_reduces of `--numel` floats through `torch.distributed.all_reduce` (the peer) and
through `disttrain.comm.all_reduce` (recorded: sequence number, shapes, call site,
watchdog), alternating which goes first so machine-load drift hits both alike. Prints
rank 0's median microseconds per call of each, the difference, and the median of the
per-round ratios ours/torch. The recorder's own cost does not depend on the tensor
size, so small tensors show it most.

    python benchmarks/flight_overhead.py                  # world 2, 64 floats
    python benchmarks/flight_overhead.py --numel 262144
    python benchmarks/flight_overhead.py --live           # the recorder alone: live file on/off
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from disttrain import comm
from disttrain.comm.flight import FlightRecorder
from disttrain.testing import spawn


def _time(fn, t: torch.Tensor, calls: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn(t)
    return (time.perf_counter() - start) / calls * 1e6  # us per call


def bench(numel: int, calls: int, rounds: int) -> dict:
    t = torch.ones(numel)
    pairs = {"torch": dist.all_reduce, "disttrain": comm.all_reduce}
    for fn in pairs.values():  # warm-up (creates the recorder and its watchdog)
        _time(fn, t, 20)
    out = {k: [] for k in pairs}
    for r in range(rounds):
        for name in (list(pairs) if r % 2 == 0 else list(pairs)[::-1]):
            out[name].append(_time(pairs[name], t, calls))
    return out


def live_cost(calls: int, rounds: int) -> dict:
    """us per start()+end() pair of a recorder without and with its live file (comm/live.py)."""
    out = {"no report folder": [], "live file": []}
    with tempfile.TemporaryDirectory() as folder:
        recs = {"no report folder": FlightRecorder(0, 2, 60), "live file": FlightRecorder(0, 2, 60, folder)}
        for r in range(rounds):
            for name in (list(recs) if r % 2 == 0 else list(recs)[::-1]):
                rec, start = recs[name], time.perf_counter()
                for _ in range(calls):
                    rec.end(rec.start("all_reduce", "world", [0, 1], [[64]], "float32"))
                out[name].append((time.perf_counter() - start) / calls * 1e6)
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--numel", type=int, default=64)
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--live", action="store_true", help="time the recorder alone, live file on and off")
    args = p.parse_args()
    if args.live:
        res = live_cost(20 * args.calls, args.rounds)
        for name, us in res.items():
            print(f"recorder start+end, {name:17s} {us:6.2f} us/collective (median of {args.rounds})")
        print(f"live file adds {res['live file'] - res['no report folder']:.2f} us/collective")
        return
    res = spawn(bench, args.world, args.numel, args.calls, args.rounds, timeout=600)[0]
    ours, peer = statistics.median(res["disttrain"]), statistics.median(res["torch"])
    ratio = statistics.median(a / b for a, b in zip(res["disttrain"], res["torch"]))
    print(f"world {args.world}, {args.numel} floats, {args.calls} calls x {args.rounds} rounds")
    print(f"torch.distributed.all_reduce   {peer:8.1f} us/call (median)")
    print(f"disttrain.comm.all_reduce      {ours:8.1f} us/call (median)")
    print(f"recorder overhead              {ours - peer:8.1f} us/call; ratio ours/torch {ratio:.3f}")


if __name__ == "__main__":
    main()
