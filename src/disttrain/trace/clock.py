"""Clock alignment: every rank's offset to rank 0's clock, measured NTP-style over gloo.

Rank 0 answers `rounds` pings from each other rank in turn (point-to-point on the
default group, before training starts): rank r sends its time t0, rank 0 stamps arrival
t1 and reply t2, rank r stamps the answer's arrival t3. For each round

    offset = ((t1 - t0) + (t2 - t3)) / 2        delay = (t3 - t0) - (t2 - t1)

and the round with the smallest delay wins: the true offset lies within +-delay/2 of
it, which is the residual error reported (and kept in the trace). The offsets are then
all-gathered so rank 0 can print them. A collective: every rank calls it.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from disttrain.trace.recorder import WALL0_US, Recorder, now_us


def _wall_us() -> float:
    return now_us() + WALL0_US

__all__ = ["align"]

TAG = 7_340_033


def _serve(world: int, rounds: int) -> None:
    buf = torch.zeros(2, dtype=torch.float64)
    for peer in range(1, world):
        for _ in range(rounds):
            dist.recv(buf[:1], peer, tag=TAG)
            t1 = _wall_us()
            buf[0], buf[1] = t1, _wall_us()
            dist.send(buf, peer, tag=TAG)


def _ping(rounds: int) -> tuple[float, float]:
    buf = torch.zeros(2, dtype=torch.float64)
    best = (0.0, float("inf"))
    for _ in range(rounds):
        t0 = _wall_us()
        buf[0] = t0
        dist.send(buf[:1], 0, tag=TAG)
        dist.recv(buf, 0, tag=TAG)
        t3 = _wall_us()
        t1, t2 = float(buf[0]), float(buf[1])
        delay = (t3 - t0) - (t2 - t1)
        if delay < best[1]:
            best = (((t1 - t0) + (t2 - t3)) / 2, delay)
    return best[0], max(0.0, best[1] / 2)


def align(rec: Recorder, rounds: int = 8, quiet: bool = False) -> list[tuple[float, float]]:
    """Measure this rank's clock offset to rank 0 and record it in `rec`; every rank calls it.

    Returns every rank's (offset_us, error_us). Rank 0 prints one line about them.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        rec.set_clock(0.0, 0.0, 0)
        return [(0.0, 0.0)]
    rank, world = dist.get_rank(), dist.get_world_size()
    offset, error = (0.0, 0.0) if rank == 0 else _ping(rounds)
    if rank == 0:
        _serve(world, rounds)
    rec.set_clock(offset, error, rounds)
    mine = torch.tensor([offset, error], dtype=torch.float64)
    every = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(every, mine)
    pairs = [(float(t[0]), float(t[1])) for t in every]
    if rank == 0 and not quiet:
        offs = [p[0] for p in pairs[1:]]
        print(f"disttrain trace: clocks of {world} ranks aligned to rank 0 ({rounds} round trips "
              f"each): offsets {min(offs):+.0f}..{max(offs):+.0f} us, residual error <= "
              f"{max(p[1] for p in pairs):.0f} us; writing {rec.directory}",
              file=sys.stderr, flush=True)
    return pairs
