"""Module-level functions run by tests/dist/test_spawn.py in spawned ranks."""

import time

import torch
import torch.distributed as dist

import disttrain


def sum_of_ranks(scale):
    t = torch.tensor([float(disttrain.rank())])
    dist.all_reduce(t)
    return {"rank": disttrain.rank(), "world": disttrain.world_size(), "sum": t * scale}


def rank_one_raises():
    if disttrain.rank() == 1:
        raise ValueError("rank one says no")
    dist.barrier()


def rank_one_sleeps():
    if disttrain.rank() == 1:
        time.sleep(60)
    return disttrain.rank()
