"""Where one push+pull's time goes: a timeline of both processes, median over iterations.

    python benchmarks/ps_timeline.py [--size 4M] [--iters 40] [--ipc]

One worker and one server (`ps.serve` / `ps.attach`, one float32 parameter of `--size`,
Async, SGD), over TCP loopback unless `--ipc`; each iteration is `push()` then `pull()`
and a wait on both, as in benchmarks/ps_transport.py. Both processes stamp the start and
end of the wire's steps with `time.perf_counter()` (CLOCK_MONOTONIC: one clock for both
processes): sealing a frame (its MAC), queueing it to ZeroMQ, a frame returned by ZeroMQ,
opening it (its MAC checked), the server's optimizer step, the worker's copy into the
model. Printed: each stamp's median offset from the iteration's start (W: worker, S:
server; `>` start, `<` end; #n: the n-th such stamp of the iteration), so the gaps say
what runs one after the other. The stamps wrap library methods from outside (nothing in
the library is changed); they add a few microseconds each.
"""

from __future__ import annotations

import argparse
import collections
import os
import secrets
import statistics
import time

import torch

import disttrain
from disttrain import ps
from disttrain.testing import spawn

STAMPS: list[tuple[str, float]] = []


def _stamp(cls, name: str, label: str) -> None:
    f = getattr(cls, name)

    def stamped(*a, **k):
        STAMPS.append((label + ">", time.perf_counter()))
        try:
            return f(*a, **k)
        finally:
            STAMPS.append((label + "<", time.perf_counter()))
    setattr(cls, name, stamped)


def _instrument() -> None:
    import zmq

    from disttrain.ps import endpoint, server, session, worker
    _stamp(session.Session, "seal_parts", "seal")
    _stamp(session.Session, "open", "open")
    _stamp(endpoint.Endpoint, "_put", "queue")
    _stamp(server.Server, "_apply", "step")
    _stamp(worker.Worker, "_write_params", "copy into model")
    recv = zmq.Socket.recv_multipart

    def received(self, *a, **k):
        out = recv(self, *a, **k)
        STAMPS.append(("frame received", time.perf_counter()))
        return out
    zmq.Socket.recv_multipart = received


def _run(numel: int, iters: int) -> list:
    _instrument()
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(numel))
    if disttrain.role() == "server":
        ps.serve(model, ps.Async(), lambda p: torch.optim.SGD(p, lr=0.01), timeout=60)
        return STAMPS
    conn = ps.attach(model, ps.Async(), timeout=60, overlap=False)
    model.w.grad = torch.randn(numel)
    for _ in range(3):  # warm-up
        pushed = conn.push()
        conn.pull().wait()
        pushed.wait()
    STAMPS.clear()
    for _ in range(iters):
        STAMPS.append(("START", time.perf_counter()))
        pushed = conn.push()
        conn.pull().wait()
        pushed.wait()
        STAMPS.append(("END", time.perf_counter()))
    out = list(STAMPS)
    conn.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="4M")
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--ipc", action="store_true", help="ipc:// (default path), not TCP")
    args = parser.parse_args()
    units = {"K": 1 << 10, "M": 1 << 20}
    nbytes = int(float(args.size[:-1]) * units[args.size[-1].upper()])
    env = {"DISTTRAIN_SERVERS": "1", "DISTTRAIN_SECRET": secrets.token_hex(32),
           "OMP_NUM_THREADS": "1", "DISTTRAIN_PS_IPC": "1" if args.ipc else "0"}
    worker, server = spawn(_run, 2, nbytes // 4, args.iters, env=env, timeout=600)
    stamps = [("W " + k, t) for k, t in worker] + [("S " + k, t) for k, t in server]
    stamps.sort(key=lambda s: s[1])
    starts = [t for k, t in worker if k == "START"]
    ends = [t for k, t in worker if k == "END"]
    offsets = collections.defaultdict(list)
    for a, b in zip(starts, ends):
        seen: collections.Counter = collections.Counter()
        for k, t in stamps:
            if a <= t <= b and k != "W START":
                seen[k] += 1
                offsets[(k, seen[k])].append((t - a) * 1e3)
    print(f"{args.size} push+pull over {'ipc://' if args.ipc else 'TCP'}, {len(starts)} "
          f"iterations, load average {os.getloadavg()[0]:.1f}; ms from the start (median):")
    for (k, n), v in sorted(offsets.items(), key=lambda kv: statistics.median(kv[1])):
        if len(v) >= len(starts) // 2:  # stamps most iterations have
            print(f"{statistics.median(v):9.3f}  {k} #{n}")


if __name__ == "__main__":
    main()
