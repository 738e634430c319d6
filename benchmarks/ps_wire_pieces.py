"""Would cutting a key's bytes into smaller authenticated frames pipeline its MAC with its
transfer? The wire alone, without the parameter server around it.

    python benchmarks/ps_wire_pieces.py [--size 4M] [--pieces 1,2,4,8] [--rounds 12]

Two processes on a ZeroMQ PAIR over TCP loopback. One round trip = the client sends
`--size` bytes as P frames, each [AES-GMAC tag of the piece (its own nonce), piece], sent
without a copy; the server receives each, checks its tag and copies the piece into its
buffer (as a server steps or a worker copies into its model once the tag verified), then
sends it all back the same way; the client checks and copies likewise. With P > 1 the
sender tags piece i+1 while ZeroMQ's I/O thread writes piece i, and the receiver checks
piece i while piece i+1 is read: the overlap that cutting the stream would buy, at the
cost of P-1 more frames. The piece counts alternate on one connection (`--rounds` rounds
of 15 round trips each, the first round not counted), so both sides see the same
machine; printed: each P's median over rounds and the median of the per-round speed-up
against the first P (> 1: faster).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import torch
import zmq
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

KEY = bytes(range(32))
PER_ROUND = 15


def _tag(seq: int, piece) -> bytes:
    enc = Cipher(algorithms.AES(KEY), modes.GCM(seq.to_bytes(12, "little"))).encryptor()
    enc.authenticate_additional_data(piece)
    enc.finalize()
    return enc.tag


def _send(sock, buf: memoryview, pieces: int, seq: int) -> int:
    step = -(-len(buf) // pieces)
    for at in range(0, len(buf), step):
        sock.send_multipart([_tag(seq, buf[at:at + step]), buf[at:at + step]], copy=False)
        seq += 1
    return seq


def _recv(sock, into: torch.Tensor, pieces: int, seq: int) -> int:
    step = -(-into.numel() // pieces)
    for at in range(0, into.numel(), step):
        tag, piece = sock.recv_multipart(copy=False)
        if _tag(seq, piece.buffer) != tag.bytes:
            raise RuntimeError(f"piece {seq}: bad tag")
        into[at:at + step].copy_(torch.frombuffer(piece.buffer, dtype=torch.uint8))
        seq += 1
    return seq


def _server(port_q, nbytes: int, plan: list[int]) -> None:
    torch.set_num_threads(1)
    sock = zmq.Context().socket(zmq.PAIR)
    port_q.put(sock.bind_to_random_port("tcp://127.0.0.1"))
    buf, seq = torch.empty(nbytes, dtype=torch.uint8), 0
    for pieces in plan:
        seq = _recv(sock, buf, pieces, seq)
        seq = _send(sock, memoryview(buf.numpy()), pieces, seq)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="4M")
    parser.add_argument("--pieces", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    nbytes = int(float(args.size[:-1]) * {"K": 1 << 10, "M": 1 << 20}[args.size[-1].upper()])
    counts = [int(p) for p in args.pieces.split(",")]
    plan = [p for _ in range(args.rounds) for p in counts for _ in range(PER_ROUND)]
    port_q = mp.get_context("spawn").Queue()
    server = mp.get_context("spawn").Process(target=_server, args=(port_q, nbytes, plan))
    server.start()
    torch.set_num_threads(1)
    sock = zmq.Context().socket(zmq.PAIR)
    sock.connect(f"tcp://127.0.0.1:{port_q.get()}")
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    back, seq = torch.empty_like(src), 0
    times: dict[int, list[float]] = {p: [] for p in counts}
    load = os.getloadavg()[0]
    for r in range(args.rounds):
        for pieces in counts:
            trips = []
            for _ in range(PER_ROUND):
                t0 = time.perf_counter()
                seq = _send(sock, memoryview(src.numpy()), pieces, seq)
                seq = _recv(sock, back, pieces, seq)
                trips.append(time.perf_counter() - t0)
            if r:
                times[pieces].append(statistics.median(trips) * 1e3)
    server.join()
    print(f"{args.size} round trip over TCP in P authenticated pieces, load average "
          f"{load:.1f} -> {os.getloadavg()[0]:.1f} ({os.cpu_count()} cores):")
    for pieces, v in times.items():
        speedup = statistics.median(a / b for a, b in zip(times[counts[0]], v))
        print(f"  P={pieces:<3} {statistics.median(v):8.3f} ms  speed-up vs P={counts[0]}: "
              f"{speedup:.3f}")


if __name__ == "__main__":
    main()
