"""Module-level functions run by tests/dist/test_spawn.py in spawned ranks."""

import os
import time

import numpy as np
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


def rank_one_exits():
    if disttrain.rank() == 1:
        os._exit(3)
    time.sleep(60)


def environment_and_seed(names):
    return {"env": {n: os.environ.get(n) for n in names}, "numpy": int(np.random.randint(2**31)),
            "threads": torch.get_num_threads()}
