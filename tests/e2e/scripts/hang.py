"""A job that hangs on purpose (uses torch): `hang.py MODE`, MODE one of

- skip:     the last rank skips the second all_reduce of three, then waits in a barrier;
- mismatch: rank 1 calls broadcast where every other rank calls all_reduce;
- sleep:    rank 1 sleeps forever instead of joining the second all_reduce;
- raw:      as sleep, but rank 0 calls torch.distributed.all_reduce (not recorded).

Lines the tests look for are marked `# at:NAME`.
"""

import sys
import time

import torch
import torch.distributed as dist

import disttrain
from disttrain import comm

disttrain.init()
rank, world = disttrain.rank(), disttrain.world_size()
mode = sys.argv[1]
t = torch.ones(4)
comm.all_reduce(t)  # at:first
if mode == "skip":
    for step in range(2):
        if rank == world - 1 and step == 0:
            continue  # the bug: one rank skips a step's all_reduce
        comm.all_reduce(t)  # at:loop
    comm.barrier()  # at:barrier
elif mode == "mismatch":
    if rank == 1:
        comm.broadcast(t, src=0)  # at:broadcast
    else:
        comm.all_reduce(t)  # at:allreduce
elif mode == "sleep":
    if rank == 1:
        time.sleep(600)  # at:sleep
    comm.all_reduce(t)  # at:after-sleep
elif mode == "raw":
    if rank == 1:
        time.sleep(600)  # at:raw-sleep
    dist.all_reduce(t)  # at:raw
print(f"rank {rank} done (should not happen)", flush=True)
