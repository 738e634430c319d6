"""Push+pull round trip: disttrain.ps vs a torch.distributed.rpc parameter server vs raw ZeroMQ.

    python benchmarks/ps_transport.py [--sizes 1K,64K,1M,4M,16M,64M] [--reps 5] [--rpc-tcp]

Two processes (one trainer/worker, one server), the same layout for all three; one
iteration sends a gradient of the given size to the server and brings the updated
parameters (same size) back:

- disttrain: `ps.connect` with one float32 parameter of the given size, `Async()` policy,
  server-side SGD; one iteration = `push()` then `pull()`, both queued at once (ps-lite
  style), then `wait()` on both. HMAC-SHA256 on every frame both ways; the server
  steps its optimizer and answers the pull with the new version's parameters.
- torch rpc: the PyTorch "batch-updating parameter server" tutorial's pattern: the
  trainer calls `rpc_sync(ps, update_and_fetch, (rref, grad))`, the server adds the
  gradient (SGD) and returns the parameters. TensorPipe with its defaults (on one host:
  shared-memory transport, cross-memory-attach channel); `--rpc-tcp` restricts it to
  TCP (uv transport, basic channel), the wire disttrain uses. No authentication.
- raw ZeroMQ: DEALER->ROUTER echo of the same bytes in the same <= 4 MB parts, nothing
  else: the transport's limit.

"4xMAC ms" is what authenticating one iteration costs at least: the MAC of the bytes
computed 4 times (worker signs the push, server checks it, server signs the new
parameters, worker checks them), timed in the trainer process during the run.

Each repetition runs an rpc block and a disttrain+zmq block, each in a fresh pair of
processes (see `run` for why), alternating which goes first; each measurement comes
after 2 warm-up iterations that are not timed; the medians over repetitions are printed with
bytes moved per second (both directions) and the ratios rpc/disttrain and zmq/disttrain
of the times (> 1: disttrain is faster).
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
import zmq

import disttrain
from disttrain import ps
from disttrain.ps.ring import DEFAULT_CHUNK_BYTES
from disttrain.ps.transport import _mac
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
        # NOTE: the pull queues behind the push on the same socket, so it answers with
        # the version that includes this gradient (what update_and_fetch returns).
        pushed = conn.push()
        conn.pull().wait()
        pushed.wait()
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
                parts = sock.recv_multipart(copy=False)
                sock.send_multipart(parts, copy=False)
            sock.close(linger=1000)
            return None
        sock = ctx.socket(zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{store.get(f'zmq/{tag}').decode()}")
        flat = memoryview(torch.randn(numel).numpy()).cast("B")
        step = DEFAULT_CHUNK_BYTES  # the parts a ps frame of this size has
        parts = [flat[i:i + step] for i in range(0, len(flat), step)] or [flat]
        for i in range(n + 2):
            if i == 2:
                t0 = time.perf_counter()
            sock.send_multipart(parts, copy=len(flat) < (64 << 10))
            sock.recv_multipart(copy=False)
        sock.close(linger=0)
        return (time.perf_counter() - t0) / n
    finally:
        ctx.term()


def _mac_floor(numel: int, tag: str) -> float | None:
    """Seconds to MAC `numel` float32s 4 times, as one push+pull does (median of 5).

    The trainer hashes while the server waits on the store (asleep, not in a collective
    that may spin), so the MAC gets the cores it gets in a real push+pull.
    """
    store = dist.distributed_c10d._get_default_store()
    if disttrain.rank() != 0:
        store.wait([f"mac/{tag}"], timedelta(seconds=600))
        return None
    buf = memoryview(torch.randn(numel).numpy()).cast("B")
    step = DEFAULT_CHUNK_BYTES
    parts = [buf[i:i + step] for i in range(0, len(buf), step)] or [buf]
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        for _ in range(4):
            _mac(b"k" * 32, b"header", parts)
        times.append(time.perf_counter() - t0)
    store.set(f"mac/{tag}", "done")
    return statistics.median(times[1:])


def _rpc_block(sizes: list[int], port: int, rpc_tcp: bool) -> dict:
    """One repetition of the rpc baseline over all sizes (both ranks call it)."""
    rank = disttrain.rank()
    tcp = {"_transports": ["uv"], "_channels": ["basic"]} if rpc_tcp else {}
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                           rpc_timeout=120, **tcp)
    rpc.init_rpc("trainer" if rank == 0 else "server", rank=rank, world_size=2,
                 rpc_backend_options=opts)
    out = {}
    for nbytes in sizes:
        numel = nbytes // 4
        rref = rpc.remote("server", RpcParameterServer, args=(numel,)) if rank == 0 else None
        out[str(nbytes)] = {"rpc": _bench_rpc(numel, rref)}
        del rref
    rpc.shutdown()
    return out


def _ours_block(sizes: list[int], rep: int) -> dict:
    """One repetition of disttrain, raw ZeroMQ and the MAC floor over all sizes."""
    out = {}
    for nbytes in sizes:
        numel = nbytes // 4
        out[str(nbytes)] = {"disttrain": _bench_ps(numel, f"{nbytes}-{rep}")}
        dist.barrier()
        out[str(nbytes)]["zmq"] = _bench_zmq(numel, f"{nbytes}-{rep}")
        dist.barrier()
        out[str(nbytes)]["mac"] = _mac_floor(numel, f"{nbytes}-{rep}")
        dist.barrier()
    return out


def run(sizes: list[int], reps: int, rpc_tcp: bool) -> dict:
    """All blocks, alternating which side goes first; {size: {side: [seconds per rep]}}.

    NOTE: each block runs in a fresh pair of processes (same layout: rank 0 trainer,
    rank 1 server): TensorPipe's default shared-memory transport busy-polls a core per
    process while its agent lives (even idle), so it must not run beside the others on
    a small machine, and RRefs do not survive an rpc re-init in one process.
    """
    env = {"DISTTRAIN_SERVERS": "1", "DISTTRAIN_SECRET": secrets.token_hex(32),
           "OMP_NUM_THREADS": "1"}
    out = {str(n): {"disttrain": [], "rpc": [], "zmq": [], "mac": []} for n in sizes}
    for rep in range(reps):
        order = ("rpc", "ours") if rep % 2 == 0 else ("ours", "rpc")
        for side in order:
            if side == "rpc":
                got = spawn(_rpc_block, 2, sizes, _free_port(), rpc_tcp, env=env, timeout=1500)
            else:
                got = spawn(_ours_block, 2, sizes, rep, env=env, timeout=1500)
            for size, times in got[0].items():
                for k, v in times.items():
                    out[size][k].append(v)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1K,64K,1M,4M,16M,64M")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rpc-tcp", action="store_true",
                        help="restrict TensorPipe to TCP (uv transport, basic channel)")
    args = parser.parse_args()
    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    results = run(sizes, args.reps, args.rpc_tcp)
    print(f"{'size':>8} {'disttrain ms':>13} {'rpc ms':>9} {'zmq ms':>9} {'4xMAC ms':>9} "
          f"{'disttrain MB/s':>15} {'rpc MB/s':>9} {'zmq MB/s':>9} {'dt/rpc':>7} {'dt/zmq':>7}")
    for nbytes in sizes:
        med = {k: statistics.median(v) for k, v in results[str(nbytes)].items()}
        mbps = {k: 2 * nbytes / v / 1e6 for k, v in med.items()}  # both directions
        label = f"{nbytes >> 20}M" if nbytes >= 1 << 20 else f"{nbytes >> 10}K"
        print(f"{label:>8} {med['disttrain'] * 1e3:13.3f} {med['rpc'] * 1e3:9.3f} "
              f"{med['zmq'] * 1e3:9.3f} {med['mac'] * 1e3:9.3f} {mbps['disttrain']:15.1f} "
              f"{mbps['rpc']:9.1f} {mbps['zmq']:9.1f} {med['rpc'] / med['disttrain']:7.2f}x "
              f"{med['zmq'] / med['disttrain']:7.2f}x", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
