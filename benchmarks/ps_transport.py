"""Push+pull round trip: disttrain.ps vs a torch.distributed.rpc parameter server vs raw ZeroMQ.

    python benchmarks/ps_transport.py [--sizes 1K,64K,1M,4M,16M,64M] [--reps 5] [--rpc-tcp]
        [--chunk 4M] [--tcp] [--compare-tcp] [--compare-mac] [--compare-socket] [--before REV]
    python benchmarks/ps_transport.py --targets [--reps 5]   # the three target rows

`--targets` is `--sizes 1K,4M,16M,64M --compare-tcp --compare-mac --compare-socket
--before c7c37ba` and ends with a table of the targets: loopback servers on ipc:// (the
default: tensors through a shared-memory segment between processes of one user, only
the authenticated header on the socket) vs rpc, the same over the socket without a MAC
over the tensors (DISTTRAIN_PS_SHM=0, the default before), TCP with a MAC on every frame
vs rpc, and 1 KB frames vs the HMAC-SHA256 wire (c7c37ba); the load average before and
after is printed with it.

Two processes (one trainer/worker, one server), the same layout for all sides; one
iteration sends a gradient of the given size to the server and brings the updated
parameters (same size) back:

- disttrain: `ps.serve` / `ps.attach` with one float32 parameter of the given size, `Async()` policy,
  server-side SGD; one iteration = `push()` then `pull()`, both queued at once (ps-lite
  style), then `wait()` on both. Every frame authenticated (session MAC) both ways, on
  ipc:// between processes of one user the tensors go through a shared-memory segment
  and only the header on the socket (envelope, part lengths and header authenticated;
  docs/design/parameter-server.md, "Threat model", "Shared memory on one host"); the server
  steps its optimizer and answers the pull with the new version's parameters.
  `--chunk` sets `chunk_bytes` (keys and chunk messages; a list runs each, interleaved);
  `--tcp` sets DISTTRAIN_PS_IPC=0 (TCP loopback instead of the ipc:// Unix socket a
  loopback server uses); `--compare-tcp` adds a TCP run of the first chunk size (every
  byte authenticated); `--compare-mac` adds an ipc:// run with DISTTRAIN_PS_MAC=always
  (every byte authenticated there too: what skipping the buffers' MAC saves);
  `--compare-socket` adds an ipc:// run with DISTTRAIN_PS_SHM=0 (tensors on the socket
  without a MAC: what the shared-memory segment saves).
- before: the same disttrain side with the library of git revision REV (`--before`),
  run from an export of that revision's src/ in a subprocess: the wire before this one.
- torch rpc: the PyTorch "batch-updating parameter server" tutorial's pattern: the
  trainer calls `rpc_sync(ps, update_and_fetch, (rref, grad))`, the server adds the
  gradient (SGD) and returns the parameters. TensorPipe with its defaults (on one host:
  shared-memory transport, cross-memory-attach channel); `--rpc-tcp` restricts it to
  TCP (uv transport, basic channel). No authentication.
- raw ZeroMQ: DEALER->ROUTER echo of the same bytes in the same chunk-sized parts over
  the same ZeroMQ transport as disttrain (ipc://, or TCP with --tcp), nothing else.

"4xMAC ms" is what authenticating one iteration costs at least: the session MAC of the
bytes computed 4 times (worker signs the push, server checks it, server signs the new
parameters, worker checks them), timed in the trainer process during the run.

Each repetition runs an rpc block, a disttrain+zmq block and (with --before) a before
block, each in a fresh pair of processes (see `run` for why), rotating which goes first;
each measurement comes after 2 warm-up iterations that are not timed; the medians over
repetitions are printed with bytes moved per second (both directions) and the ratios
rpc/disttrain, zmq/disttrain and before/disttrain of the times (> 1: disttrain is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
import zmq

import disttrain
from disttrain import ps
from disttrain.testing import spawn

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # NOTE: run as a script or imported from elsewhere
    sys.path.insert(0, HERE)
from _ps_timing import WARMUP, iters, seconds_per_iter, time_push_pull  # noqa: E402

ROOT = os.path.dirname(HERE)
HMAC_WIRE = "c7c37ba"  # the last revision with the HMAC-SHA256 hash-then-MAC wire


class RpcParameterServer:
    """The tutorial's server object: holds the parameter, applies SGD, returns it."""

    def __init__(self, numel: int):
        self.param = torch.zeros(numel)

    @staticmethod
    def update_and_fetch(ps_rref, grad):
        self = ps_rref.local_value()
        self.param.add_(grad, alpha=-0.01)
        return self.param


def _join(model, tag: str, chunk: int):
    """This rank's entry point: the server's stats or the worker's `Worker`."""
    opt = lambda p: torch.optim.SGD(p, lr=0.01)  # noqa: E731
    if not hasattr(ps, "serve"):  # NOTE: --before revisions have only connect(exit=False)
        return ps.connect(model, ps.Async(), opt, exit=False, timeout=60, name=tag,
                          overlap=False, chunk_bytes=chunk)
    if disttrain.role() == "server":
        return ps.serve(model, ps.Async(), opt, timeout=60, name=tag, chunk_bytes=chunk)
    return ps.attach(model, ps.Async(), timeout=60, name=tag, overlap=False, chunk_bytes=chunk)


def _bench_ps(numel: int, tag: str, chunk: int) -> float | None:
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(numel))
    conn = _join(model, tag, chunk)
    if disttrain.role() == "server":
        return None
    model.w.grad = torch.randn(numel)
    return time_push_pull(conn, numel * 4)  # the pull answers what update_and_fetch returns


def _bench_rpc(numel: int, rref) -> float | None:
    if rref is None:
        return None
    grad = torch.randn(numel)
    return seconds_per_iter(lambda: rpc.rpc_sync(
        "server", RpcParameterServer.update_and_fetch, args=(rref, grad)), numel * 4)


def _bench_zmq(numel: int, tag: str, chunk: int) -> float | None:
    store = dist.distributed_c10d._get_default_store()
    ctx = zmq.Context()
    folder = tempfile.mkdtemp(prefix="ps-bench-")
    try:
        if disttrain.rank() == 1:
            sock = ctx.socket(zmq.ROUTER)
            if os.environ.get("DISTTRAIN_PS_IPC", "1") == "0":
                addr = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
            else:
                addr = f"ipc://{folder}/echo.sock"
                sock.bind(addr)
            store.set(f"zmq/{tag}", addr)
            for _ in range(iters(numel * 4) + WARMUP):
                parts = sock.recv_multipart(copy=False)
                sock.send_multipart(parts, copy=False)
            sock.close(linger=1000)
            return None
        sock = ctx.socket(zmq.DEALER)
        sock.connect(store.get(f"zmq/{tag}").decode())
        flat = memoryview(torch.randn(numel).numpy()).cast("B")
        step = chunk  # the parts a ps push of this size has
        parts = [flat[i:i + step] for i in range(0, len(flat), step)] or [flat]

        def echo():
            sock.send_multipart(parts, copy=len(flat) < (64 << 10))
            sock.recv_multipart(copy=False)

        dt = seconds_per_iter(echo, numel * 4)
        sock.close(linger=0)
        return dt
    finally:
        ctx.term()
        shutil.rmtree(folder, ignore_errors=True)


def _mac_floor(numel: int, tag: str, chunk: int) -> float | None:
    """Seconds to MAC `numel` float32s 4 times, as one push+pull does (median of 5).

    The trainer signs while the server waits on the store (asleep, not in a collective
    that may spin), so the MAC gets the cores it gets in a real push+pull.
    """
    from disttrain.ps.session import Session  # NOTE: not in --before revisions

    store = dist.distributed_c10d._get_default_store()
    if disttrain.rank() != 0:
        store.wait([f"mac/{tag}"], timedelta(seconds=600))
        return None
    buf = memoryview(torch.randn(numel).numpy()).cast("B")
    parts = [buf[i:i + chunk] for i in range(0, len(buf), chunk)] or [buf]
    session = Session(b"k" * 32, bytes(16), bytes(16), 0, 0, "worker")
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        for _ in range(4):
            for p in parts:
                session.seal_parts(b"header", [p])
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


def _ours_block(sizes: list[int], rep: int, chunk: int) -> dict:
    """One repetition of disttrain, raw ZeroMQ and the MAC floor over all sizes."""
    out = {}
    for nbytes in sizes:
        numel, tag = nbytes // 4, f"{nbytes}-{rep}"
        out[str(nbytes)] = {"disttrain": _bench_ps(numel, tag, chunk)}
        dist.barrier()
        out[str(nbytes)]["zmq"] = _bench_zmq(numel, tag, chunk)
        dist.barrier()
        out[str(nbytes)]["mac"] = _mac_floor(numel, tag, chunk)
        dist.barrier()
    return out


def _before_block(sizes: list[int], rep: int, chunk: int) -> dict:
    """One repetition of the disttrain side alone (run under an older library)."""
    out = {}
    for nbytes in sizes:
        out[str(nbytes)] = {"before": _bench_ps(nbytes // 4, f"b{nbytes}-{rep}", chunk)}
        dist.barrier()
    return out


def _run_before(src: str, sizes: list[int], rep: int, chunk: int) -> dict:
    """_before_block in a subprocess whose `disttrain` is the export at `src`."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(  # NOTE: its disttrain first
        [src] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    cmd = [sys.executable, __file__, "--block-before", json.dumps([sizes, rep, chunk])]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500)
    if res.returncode != 0:
        raise RuntimeError(f"before block failed:\n{res.stdout[-2000:]}{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _export(rev: str) -> str:
    """src/ of git revision `rev`, exported to a temporary folder; returns its path (a
    folder `rev` holding a src/ is used as it is: a machine without the git history)."""
    if os.path.isdir(rev):
        return os.path.join(os.path.abspath(rev), "src")
    folder = tempfile.mkdtemp(prefix="ps-before-")
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "src"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    return os.path.join(folder, "src")


def _env() -> dict:
    return {"DISTTRAIN_SERVERS": "1", "DISTTRAIN_SECRET": secrets.token_hex(32),
            "OMP_NUM_THREADS": "1"}


def run(sizes: list[int], reps: int, rpc_tcp: bool, variants: list[tuple[str, int, dict]],
        before: str | None, save: str | None = None) -> dict:
    """All blocks, rotating which side goes first; {size: {side: [seconds per rep]}}.

    `variants` are (label, chunk_bytes, extra env) of the disttrain side: each runs as its
    own block in the rotation (disttrain, its echo and MAC floor), its results keyed
    "disttrain@<label>"; the first variant's are also plain "disttrain", "zmq", "mac".
    `before` runs with the first variant's chunk size. With `save`, the results so far are
    written there as JSON after every repetition.

    NOTE: each block runs in a fresh pair of processes (same layout: rank 0 trainer,
    rank 1 server): TensorPipe's default shared-memory transport busy-polls a core per
    process while its agent lives (even idle), so it must not run beside the others on
    a small machine, and RRefs do not survive an rpc re-init in one process.
    """
    src = _export(before) if before else None
    keep = bool(before) and os.path.isdir(before)
    sides = ["rpc", *range(len(variants))] + (["before"] if before else [])
    out = {str(n): {k: [] for k in ("disttrain", "rpc", "zmq", "mac", "before")}
           for n in sizes}
    for rep in range(reps):
        for side in sides[rep % len(sides):] + sides[:rep % len(sides)]:
            if side == "rpc":
                got = spawn(_rpc_block, 2, sizes, _free_port(), rpc_tcp, env=_env(),
                            timeout=1500)[0]
            elif side == "before":
                got = _run_before(src, sizes, rep, variants[0][1])
            else:
                label, chunk, extra = variants[side]
                got = spawn(_ours_block, 2, sizes, rep, chunk, env={**_env(), **extra},
                            timeout=1500)[0]
                got = {n: {**(t if side == 0 else {}),
                           **{f"{k}@{label}": v for k, v in t.items()}} for n, t in got.items()}
            for size, times in got.items():
                for k, v in times.items():
                    out[size].setdefault(k, []).append(v)
        if save:
            with open(save, "w") as f:
                json.dump(out, f)
    if src and not keep:
        shutil.rmtree(os.path.dirname(src), ignore_errors=True)
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
    parser.add_argument("--chunk", default="4M",
                        help="disttrain's chunk_bytes; a list (1M,4M) adds a table per chunk")
    parser.add_argument("--tcp", action="store_true",
                        help="disttrain and the echo over TCP loopback (DISTTRAIN_PS_IPC=0)")
    parser.add_argument("--compare-tcp", action="store_true",
                        help="also run disttrain and the echo over TCP, interleaved")
    parser.add_argument("--compare-mac", action="store_true",
                        help="also run disttrain over ipc:// with DISTTRAIN_PS_MAC=always")
    parser.add_argument("--compare-socket", action="store_true",
                        help="also run disttrain over ipc:// with DISTTRAIN_PS_SHM=0")
    parser.add_argument("--before", default=None, metavar="REV",
                        help="also time the disttrain side of git revision REV (or of REV/src)")
    parser.add_argument("--save", default=None, metavar="JSON",
                        help="write the results so far to JSON after every repetition")
    parser.add_argument("--targets", action="store_true",
                        help="the targets: 1K,4M,16M,64M, ipc vs tcp+MAC vs ipc+MAC "
                             "vs rpc, 1K vs the HMAC wire (c7c37ba); a targets table at the end")
    parser.add_argument("--block-before", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.block_before:  # NOTE: the subprocess of _run_before
        sizes, rep, chunk = json.loads(args.block_before)
        print(json.dumps(spawn(_before_block, 2, sizes, rep, chunk, env=_env(),
                               timeout=1500)[0]))
        return
    if args.targets:
        args.sizes, args.compare_tcp, args.compare_mac = "1K,4M,16M,64M", True, True
        args.compare_socket = True
        args.before = args.before or HMAC_WIRE
    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    chunks = [_parse_size(c) for c in args.chunk.split(",")]
    ipc = {"DISTTRAIN_PS_IPC": "0" if args.tcp else "1"}
    variants = [(_label(c), c, ipc) for c in chunks]
    if args.compare_tcp:
        variants.append(("tcp", chunks[0], {"DISTTRAIN_PS_IPC": "0"}))
    if args.compare_mac:
        variants.append(("ipc+MAC", chunks[0], {"DISTTRAIN_PS_IPC": "1",
                                                "DISTTRAIN_PS_MAC": "always"}))
    if args.compare_socket:
        variants.append(("socket", chunks[0], {"DISTTRAIN_PS_IPC": "1", "DISTTRAIN_PS_SHM": "0"}))
    load = os.getloadavg()
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
          f"({os.cpu_count()} cores)", flush=True)
    results = run(sizes, args.reps, args.rpc_tcp, variants, args.before, args.save)
    load = os.getloadavg()
    print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    print(f"{'size':>8} {'disttrain ms':>13} {'rpc ms':>9} {'zmq ms':>9} {'4xMAC ms':>9} "
          f"{'before ms':>10} {'disttrain MB/s':>15} {'rpc MB/s':>9} {'zmq MB/s':>9} "
          f"{'dt/rpc':>7} {'dt/zmq':>7} {'dt/before':>9}")
    for nbytes in sizes:
        med = {k: statistics.median(v) if v else float("nan")
               for k, v in results[str(nbytes)].items()}
        mbps = {k: 2 * nbytes / v / 1e6 for k, v in med.items()}  # both directions
        print(f"{_label(nbytes):>8} {med['disttrain'] * 1e3:13.3f} {med['rpc'] * 1e3:9.3f} "
              f"{med['zmq'] * 1e3:9.3f} {med['mac'] * 1e3:9.3f} {med['before'] * 1e3:10.3f} "
              f"{mbps['disttrain']:15.1f} {mbps['rpc']:9.1f} {mbps['zmq']:9.1f} "
              f"{med['rpc'] / med['disttrain']:7.2f}x {med['zmq'] / med['disttrain']:7.2f}x "
              f"{med['before'] / med['disttrain']:8.2f}x", flush=True)
    if len(variants) > 1:
        print("\ndisttrain ms (dt/rpc) and its echo's ms per variant (chunk_bytes or tcp):")
        print(f"{'size':>8} " + " ".join(f"{v[0]:>27}" for v in variants))
        for nbytes in sizes:
            res = results[str(nbytes)]
            rpc_ms = statistics.median(res["rpc"]) * 1e3
            cells = [(statistics.median(res[f"disttrain@{v[0]}"]) * 1e3,
                      statistics.median(res[f"zmq@{v[0]}"]) * 1e3) for v in variants]
            print(f"{_label(nbytes):>8} " + " ".join(
                f"{ms:8.3f} ({rpc_ms / ms:4.2f}x) zmq {z:7.3f}" for ms, z in cells), flush=True)
    if args.targets:
        _print_targets(results, args.reps)


def _print_targets(results: dict, reps: int) -> None:
    """Issue 21's targets: the ratio of medians (> 1: disttrain faster) and met or not."""
    rows = [("ipc:// (default)", "4M", "disttrain", "rpc", 1.0),
            ("ipc:// (default)", "16M", "disttrain", "rpc", 1.0),
            ("ipc:// (default)", "64M", "disttrain", "rpc", 1.1)]
    rows += [("tcp, MAC on every frame", n, "disttrain@tcp", "rpc", 0.8) for n in ("4M", "16M", "64M")]
    rows += [("ipc://, DISTTRAIN_PS_MAC=always", n, "disttrain@ipc+MAC", "rpc", None)
             for n in ("4M", "16M", "64M")]
    rows += [("ipc://, DISTTRAIN_PS_SHM=0", n, "disttrain@socket", "rpc", None)
             for n in ("4M", "16M", "64M")]
    rows += [("1K frames vs HMAC wire (ipc)", "1K", "disttrain", "before", 1.0),
             ("1K frames vs HMAC wire (tcp)", "1K", "disttrain@tcp", "before", None)]
    print(f"\ntargets ({reps} interleaved repetitions, medians; ratio = other / disttrain):")
    print(f"{'path':>30} {'size':>5} {'disttrain ms':>13} {'other':>7} {'other ms':>9} "
          f"{'ratio':>7} {'target':>7} {'met':>4}")
    for path, size, ours, other, target in rows:
        res = results[str(_parse_size(size))]
        a, b = statistics.median(res[ours]), statistics.median(res[other])
        met = "-" if target is None else ("yes" if b / a >= target else "NO")
        want = "-" if target is None else f">={target:.1f}x"
        print(f"{path:>30} {size:>5} {a * 1e3:13.3f} {other:>7} {b * 1e3:9.3f} "
              f"{b / a:6.2f}x {want:>7} {met:>4}", flush=True)


def _label(nbytes: int) -> str:
    return f"{nbytes >> 20}M" if nbytes >= 1 << 20 else f"{nbytes >> 10}K"


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
