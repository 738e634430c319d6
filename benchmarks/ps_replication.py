"""Push+pull with replicated key ranges: replicas = 1, 2, 3 on one host and on an emulated cluster.

    python benchmarks/ps_replication.py [--sizes 4M,64M] [--replicas 1,2,3] [--reps 5]
        [--policy async|sync] [--chunk 4M]
    python benchmarks/ps_replication.py --link 1gbit [--sizes 4M,64M] [--reps 5]   # needs root

One worker, three servers (so every r of 1..3 has the same processes), one float32
parameter of the given size (4 MB chunks: a 4 MB parameter is one key on one head, a 64 MB
one spreads over the three), `Async()` (default) or `Sync()`, server-side SGD. One
iteration = `push()` and `pull()` queued at once, then `wait()` on both (as
benchmarks/ps_transport.py): with r > 1 the push is acknowledged and the pull answered only
once the update is on every copy, so the time includes the chain. 2 untimed warm-up
iterations, then `iters(size)` timed ones (benchmarks/_ps_timing.py, shared with
ps_transport.py); per repetition every r runs once, in an order rotated between
repetitions (interleaved), in one fresh set of processes (on one host) or one cluster job
(4 nodes, one rank each, each node's link to the switch at `--link`). Prints medians
over repetitions and the ratio to r = 1 (the issue's targets: r = 2 at most 1.5x r = 1
at 1 Gbit/s, 2.0x on one host, from 4 MB up).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import tempfile

import torch

import disttrain
from disttrain import ps

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # NOTE: run as a script or imported from elsewhere
    sys.path.insert(0, HERE)
from _ps_timing import time_push_pull  # noqa: E402

WORKERS, SERVERS = 1, 3


def _bench(numel: int, r: int, tag: str, policy: str, chunk: int) -> float | None:
    """Seconds per push+pull on the worker (None on a server, which serves and returns)."""
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(numel))
    pol = ps.Sync() if policy == "sync" else ps.Async()
    if disttrain.role() == "server":
        ps.serve(model, pol, lambda p: torch.optim.SGD(p, lr=0.01), timeout=120, name=tag,
                 replicas=r, chunk_bytes=chunk)
        return None
    conn = ps.attach(model, pol, timeout=120, name=tag, overlap=False, replicas=r,
                     chunk_bytes=chunk)
    model.w.grad = torch.randn(numel)
    return time_push_pull(conn, numel * 4)


def block(sizes: list[int], order: list[int], rep: int, policy: str, chunk: int) -> dict:
    """Every size at every r of `order`, in this set of processes: {size: {r: seconds}}."""
    out: dict = {}
    for nbytes in sizes:
        for r in order:
            dt = _bench(nbytes // 4, r, f"r{r}-{nbytes}-{rep}", policy, chunk)
            out.setdefault(str(nbytes), {})[str(r)] = dt
            torch.distributed.barrier()
    return out


def _one_host(sizes, replicas, reps, policy, chunk) -> list[dict]:
    from disttrain.testing import spawn

    env = {"DISTTRAIN_SERVERS": str(SERVERS), "DISTTRAIN_SECRET": secrets.token_hex(32),
           "OMP_NUM_THREADS": "1"}
    runs = []
    for rep in range(reps):  # NOTE: a fresh set of processes per repetition, r rotated
        order = replicas[rep % len(replicas):] + replicas[:rep % len(replicas)]
        runs.append(spawn(block, WORKERS + SERVERS, sizes, order, rep, policy, chunk, env=env,
                          timeout=1800)[0])
    return runs


def _cluster(sizes, replicas, reps, policy, chunk, link) -> list[dict]:
    from disttrain.cluster import net, spec
    from disttrain.launch.cluster_run import run_in_cluster

    name = f"rp{os.getpid() % 10000}"
    net.down(name)
    net.up(spec.Cluster(name, WORKERS + SERVERS, spec.parse_rate(link), "switch"))
    runs = []
    try:
        for rep in range(reps):
            order = replicas[rep % len(replicas):] + replicas[:rep % len(replicas)]
            out = tempfile.mktemp(suffix=".json")
            code = run_in_cluster(name, os.path.abspath(__file__), [
                "--inner", json.dumps([sizes, order, rep, policy, chunk, out])],
                workers=WORKERS, servers=SERVERS, run_args=["--timeout", "120"])
            if code:
                raise RuntimeError(f"cluster job exited {code}")
            with open(out) as f:
                runs.append(json.load(f))
            os.remove(out)
    finally:
        net.down(name)
    return runs


def _inner(args: str) -> None:
    """One rank inside the cluster: every r of `order` at every size; rank 0 writes."""
    sizes, order, rep, policy, chunk, out = json.loads(args)
    torch.set_num_threads(1)
    disttrain.init()
    got = block(sizes, order, rep, policy, chunk)
    if disttrain.rank() == 0:
        with open(out, "w") as f:
            json.dump(got, f)
    disttrain.shutdown()


def report(runs: list[dict], sizes: list[int], replicas: list[int], where: str) -> None:
    reps = sum(str(replicas[0]) in run[str(sizes[0])] for run in runs)
    print(f"\npush+pull, {where}: median ms over {reps} repetitions, ratio to r = 1")
    print("| size | " + " | ".join(f"r = {r} ms" for r in replicas) + " | "
          + " | ".join(f"r = {r} / r = 1" for r in replicas[1:]) + " |")
    print("|---" * (1 + 2 * len(replicas) - 1) + "|")
    for nbytes in sizes:
        med = {r: statistics.median(run[str(nbytes)][str(r)] for run in runs
                                    if str(r) in run[str(nbytes)]) for r in replicas}
        print(f"| {nbytes >> 20} MB | " + " | ".join(f"{med[r] * 1e3:.1f}" for r in replicas)
              + " | " + " | ".join(f"{med[r] / med[replicas[0]]:.2f}" for r in replicas[1:]) + " |")


def _size(text: str) -> int:
    return int(float(text[:-1]) * (1 << 20)) if text.upper().endswith("M") else int(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="4M,64M")
    p.add_argument("--replicas", default="1,2,3")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--policy", default="async", choices=("async", "sync"))
    p.add_argument("--chunk", default="4M", help="chunk_bytes (keys and stream chunks)")
    p.add_argument("--link", help="run on an emulated cluster with links of this rate (root)")
    p.add_argument("--json", help="write every repetition's times here")
    p.add_argument("--inner", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.inner:
        return _inner(a.inner)
    sizes = [_size(s) for s in a.sizes.split(",")]
    replicas = [int(r) for r in a.replicas.split(",")]
    load0 = os.getloadavg()[0]
    chunk = _size(a.chunk)
    runs = (_cluster(sizes, replicas, a.reps, a.policy, chunk, a.link) if a.link
            else _one_host(sizes, replicas, a.reps, a.policy, chunk))
    where = (f"emulated cluster, {a.link} switch, 1 worker + 3 servers on 4 nodes" if a.link
             else "one host, 1 worker + 3 servers")
    print(f"{' '.join(sys.argv)}\n{a.policy}, chunk_bytes {chunk >> 20} MB; load average {load0:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after")
    report(runs, sizes, replicas, where)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(runs, f)


if __name__ == "__main__":
    main()
