"""Chain extension while workers train: keys and bytes moved, the cut's pause, step times.

    python benchmarks/ps_transfer.py [--mb 16] [--steps 40] [--at 15] [--reps 3]

Two workers, three servers, Sync, server-side SGD with momentum 0.9, one float32
parameter of `--mb` MB (cut into keys by the placement). At head version `--at` the tail
T of server 0's keys whose chain is [0, T] (replicas=2; with replicas=1 all of server 0's
keys, T = 0 itself) sends their state to the third server Y and makes it their new tail
(ps/transfer.py), while the workers go on. Prints per run: keys and bytes moved (values
and optimizer state), frames, T's pause (the cut: copying the state and queueing the
frames, during which T serves nothing), that pause per moved key, Y's install time, and
worker 0's median step time (pull + push, waited) before, around (the 3 steps from the
cut on) and after the extension. Medians over `--reps` repetitions, each in a fresh set of
processes (disttrain.testing.spawn).
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import time

import torch
import torch.distributed as dist

import disttrain
from disttrain import ps
from disttrain.ps import transfer
from disttrain.ps.placement import plan_keys
from disttrain.ps.replica import Replicas
from disttrain.ps.server import Server
from disttrain.ps.transport import job_secret

W, S = 2, 3


def _opt(p):
    return torch.optim.SGD(p, lr=0.01, momentum=0.9)


def _model(numel: int):
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.zeros(numel))
    return m


def _moves(plan, r: int):
    if r == 1:
        return [c.key for c in plan[0]], 0, 1
    chains = {c.key: [int(s.removeprefix("server")) for s in plan.chain(c.key, r)]
              for c in plan[0]}
    tail = max({1, 2}, key=lambda t: sum(ch[-1] == t for ch in chains.values()))
    return [k for k, ch in chains.items() if ch[-1] == tail], tail, 3 - tail


def _serve(model, plan, r: int, at: int, name: str) -> dict:
    index, init, secret = disttrain.rank() - W, dict(model.named_parameters()), job_secret()
    server = Server(index, plan[index], init, ps.Sync(), _opt, list(range(W)), secret,
                    timeout=120)
    store = dist.distributed_c10d._get_default_store()
    store.set(f"disttrain/{name}/addr{index}", server.address)
    addr = {j: store.get(f"disttrain/{name}/addr{j}").decode() for j in range(S)}
    if r > 1:
        server.chain = Replicas(index, W, plan, r, init, _opt, server.policy, server.ep,
                                secret, timeout=120)
        server.chain.connect({j: a for j, a in addr.items() if j != index})
    keys, tail, new = _moves(plan, r)
    kw = dict(replicas=r, secret=secret, chunk_bytes=4 << 20)
    ext = intake = None
    if index == tail:
        ext = transfer.extend(server, plan, init, _opt, keys, new, addr[new], at_version=at, **kw)
    elif index == new:
        intake = transfer.accept(server, plan, init, _opt, tail, keys, **kw)
    server.serve()
    return {"extension": ext and ext.stats, "intake": intake and intake.stats}


def job(mb: int, r: int, steps: int, at: int, name: str) -> dict:
    torch.set_num_threads(1)
    model = _model(mb * (1 << 20) // 4)
    plan = plan_keys([(n, p.numel(), p.element_size()) for n, p in model.named_parameters()], S)
    if disttrain.role() == "server":
        return _serve(model, plan, r, at, name)
    conn = ps.attach(model, ps.Sync(), timeout=120, name=name, replicas=r, manager="")
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        conn.pull().wait()
        model.w.grad = torch.full_like(model.w, 1e-3)
        conn.push().wait()
        times.append(time.perf_counter() - t0)
    conn.close()
    return {"times": times}


def main() -> None:
    from disttrain.testing import spawn
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=16)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--at", type=int, default=15)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--replicas", default="2,1")
    args = ap.parse_args()
    env = {"DISTTRAIN_SERVERS": str(S), "DISTTRAIN_SECRET": secrets.token_hex(32),
           "OMP_NUM_THREADS": "1"}
    for r in [int(x) for x in args.replicas.split(",")]:
        rows = []
        for rep in range(args.reps):
            out = spawn(job, W + S, args.mb, r, args.steps, args.at, f"t{r}{rep}", env=env,
                        timeout=600)
            ext = next(o["extension"] for o in out[W:] if o["extension"])
            intake = next(o["intake"] for o in out[W:] if o["intake"])
            t = out[0]["times"]  # step i ends at head version i + 1: the cut is in step `at`
            rows.append((ext, intake, statistics.median(t[2:args.at - 1]),
                         max(t[args.at - 1:args.at + 2]), statistics.median(t[args.at + 3:])))
            print(f"r={r} rep {rep}: {ext['keys']} keys, {ext['bytes'] / 1e6:.2f} MB in "
                  f"{ext['frames']} frames, cut {ext['pause_s'] * 1e3:.1f} ms "
                  f"({ext['pause_s'] / ext['keys'] * 1e6:.0f} us/key), install "
                  f"{intake['install_s'] * 1e3:.1f} ms; step ms before "
                  f"{rows[-1][2] * 1e3:.1f}, around (max) {rows[-1][3] * 1e3:.1f}, after "
                  f"{rows[-1][4] * 1e3:.1f}", flush=True)
        _row(args.mb, r, rows)


def _row(mb: int, r: int, rows: list) -> None:
    """The runs' medians as a docs/benchmarks.md table row."""
    def med(f):
        return statistics.median(f(x) for x in rows)
    print(f"| {mb} MB, replicas={r} -> chain +1 | {rows[0][0]['keys']} | "
          f"{rows[0][0]['bytes'] / 1e6:.2f} | {med(lambda x: x[0]['pause_s']) * 1e3:.1f} | "
          f"{med(lambda x: x[0]['pause_s'] / x[0]['keys']) * 1e6:.0f} | "
          f"{med(lambda x: x[1]['install_s']) * 1e3:.1f} | {med(lambda x: x[2]) * 1e3:.1f} | "
          f"{med(lambda x: x[3]) * 1e3:.1f} | {med(lambda x: x[4]) * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
