"""Rank functions of the tracing tests (module level, so `disttrain.testing.spawn` finds them)."""

import time

import torch
import torch.nn.functional as F
from torch import nn

import disttrain
from disttrain import comm, trace


def traced_training(directory: str, steps: int, ring_directory: str = "") -> dict:
    """DataParallel steps plus a blocking all_reduce each, a send 0 -> 1 after; traced.
    Then, with `ring_directory`, `traced_ring` into it (a second trace, same processes)."""
    rank, world = disttrain.rank(), disttrain.world_size()
    trace.start(directory)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64 * steps * world, 32, generator=g),
                                          torch.randint(0, 4, (64 * steps * world,), generator=g))
    loader = disttrain.data.shard_loader(data, 16 * world, seed=0)
    model = disttrain.DataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    times, t_prev = [], time.perf_counter()
    for i, (x, y) in enumerate(loader):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        comm.all_reduce(torch.ones(4096))  # blocking: exposed, outside compute
        disttrain.log(loss=loss.item())
        now = time.perf_counter()
        times.append(now - t_prev)
        t_prev = now
        if i + 1 == steps:
            break
    msg = torch.full((8,), float(rank))
    if rank == 0:
        comm.send(msg, 1)
    elif rank == 1:
        comm.recv(msg, 0)
    out = {"times": times, "path": trace.stop()}
    if ring_directory:
        out["ring"] = traced_ring(ring_directory, steps)
    return out


def traced_ring(directory: str, steps: int) -> dict:
    """DataParallel with the ring algorithm (its own thread) and one late 3 MB bucket; traced.

    The injected cause: bucket_mb=100 puts every weight but the last layer's (DDP's 1 MiB
    first bucket) into one bucket that is ready only when backward ends.
    """
    trace.start(directory)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = disttrain.DataParallel(nn.Sequential(
        nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512),
        nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 4)), bucket_mb=100, algorithm="ring")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [(torch.randn(16, 64, generator=g), torch.randint(0, 4, (16,), generator=g))
               for _ in range(steps)]
    for x, y in trace.data(batches):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        disttrain.log(loss=loss.item(), tokens=x.shape[0] * 8)
    return {"path": trace.stop(), "buckets": model.num_buckets}
