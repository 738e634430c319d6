"""Push+pull round trip: disttrain.ps vs a torch.distributed.rpc parameter server vs raw ZeroMQ.

    python benchmarks/ps_transport.py [--sizes 1K,64K,1M,4M,16M,64M] [--reps 3]

Two processes (one trainer/worker, one server), the same layout for all three:

- disttrain: `ps.connect` with one float32 parameter of the given size, `Async()` policy,
  server-side SGD; one iteration = `push().wait()` then `pull().wait()` (HMAC on every
  frame both ways, the server steps its optimizer and answers with the new parameters).
- torch rpc: the PyTorch "batch-updating parameter server" tutorial's pattern: the
  trainer calls `rpc_sync(ps, update_and_fetch, (rref, grad))`, the server adds the
  gradient (SGD) and returns the parameters. TensorPipe over TCP, pickle for the call.
- raw ZeroMQ: DEALER->ROUTER echo of the same bytes, nothing else: the transport's limit.

The three are interleaved per size and repetition in the same processes; the medians
are printed with bytes moved per second (both directions) and the disttrain/rpc ratio.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
import zmq

import disttrain
from disttrain import ps
from disttrain.testing import spawn


class RpcParameterServer:
    """The tutorial's server object: holds the parameter, applies SGD, returns it."""

    def __init__(self, numel: int):
        self.param = torch.zeros(numel)

    @staticmethod
    def update_and_fetch(ps_rref, grad):
        self = ps_rref.local_value()
        self.param.add_(grad, alpha=-0.01)
        return self.param


def _iters(nbytes: int) -> int:
    return max(5, min(200, (256 << 20) // max(nbytes, 1) // 4))


def _bench_ps(numel: int, tag: str) -> float | None:
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(numel))
    conn = ps.connect(model, ps.Async(), lambda p: torch.optim.SGD(p, lr=0.01),
                      exit=False, timeout=60, name=tag, overlap=False)
    if disttrain.role() == "server":
        return None
    model.w.grad = torch.randn(numel)
    n = _iters(numel * 4)
    for i in range(n + 2):
        if i == 2:
            t0 = time.perf_counter()
        conn.push().wait()
        conn.pull().wait()
    dt = (time.perf_counter() - t0) / n
    conn.close()
    return dt


def _bench_rpc(numel: int, rref) -> float | None:
    if rref is None:
        return None
    grad = torch.randn(numel)
    n = _iters(numel * 4)
    for i in range(n + 2):
        if i == 2:
            t0 = time.perf_counter()
        rpc.rpc_sync("server", RpcParameterServer.update_and_fetch, args=(rref, grad))
    return (time.perf_counter() - t0) / n


def _bench_zmq(numel: int, tag: str) -> float | None:
    store = dist.distributed_c10d._get_default_store()
    n = _iters(numel * 4)
    ctx = zmq.Context()
    try:
        if disttrain.rank() == 1:
            sock = ctx.socket(zmq.ROUTER)
            port = sock.bind_to_random_port("tcp://127.0.0.1")
            store.set(f"zmq/{tag}", str(port))
            for _ in range(n + 2):
                ident, payload = sock.recv_multipart(copy=False)
                sock.send_multipart([ident, payload], copy=False)
            sock.close(linger=1000)
            return None
        sock = ctx.socket(zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{store.get(f'zmq/{tag}').decode()}")
        payload = torch.randn(numel).numpy()
        for i in range(n + 2):
            if i == 2:
                t0 = time.perf_counter()
            sock.send(payload, copy=False)
            sock.recv(copy=False)
        sock.close(linger=0)
        return (time.perf_counter() - t0) / n
    finally:
        ctx.term()


def run(sizes: list[int], reps: int, rpc_port: int) -> dict:
    rank = disttrain.rank()
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{rpc_port}",
                                           rpc_timeout=120)
    rpc.init_rpc("trainer" if rank == 0 else "server", rank=rank, world_size=2,
                 rpc_backend_options=opts)
    out: dict[str, dict[str, list[float]]] = {}
    for nbytes in sizes:
        numel = nbytes // 4
        rref = rpc.remote("server", RpcParameterServer, args=(numel,)) if rank == 0 else None
        times = {"disttrain": [], "rpc": [], "zmq": []}
        for rep in range(reps):
            times["disttrain"].append(_bench_ps(numel, f"{nbytes}-{rep}"))
            dist.barrier()
            times["rpc"].append(_bench_rpc(numel, rref))
            dist.barrier()
            times["zmq"].append(_bench_zmq(numel, f"{nbytes}-{rep}"))
            dist.barrier()
        out[str(nbytes)] = times
        del rref
    rpc.shutdown()
    return out


def _parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1K,64K,1M,4M,16M,64M")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"DISTTRAIN_SERVERS": "1", "DISTTRAIN_SECRET": secrets.token_hex(32),
           "OMP_NUM_THREADS": "1"}
    results = spawn(run, 2, sizes, args.reps, port, env=env, timeout=3000)[0]
    print(f"{'size':>8} {'disttrain ms':>13} {'rpc ms':>9} {'zmq ms':>9} "
          f"{'disttrain MB/s':>15} {'rpc MB/s':>9} {'zmq MB/s':>9} {'dt/rpc':>7} {'dt/zmq':>7}")
    for nbytes in sizes:
        med = {k: statistics.median(v) for k, v in results[str(nbytes)].items()}
        mbps = {k: 2 * nbytes / v / 1e6 for k, v in med.items()}  # both directions
        label = f"{nbytes >> 20}M" if nbytes >= 1 << 20 else f"{nbytes >> 10}K"
        print(f"{label:>8} {med['disttrain'] * 1e3:13.3f} {med['rpc'] * 1e3:9.3f} "
              f"{med['zmq'] * 1e3:9.3f} {mbps['disttrain']:15.1f} {mbps['rpc']:9.1f} "
              f"{mbps['zmq']:9.1f} {med['rpc'] / med['disttrain']:7.2f}x "
              f"{med['zmq'] / med['disttrain']:7.2f}x", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
