"""Report this rank's launcher environment as JSON and all_reduce its rank (world 1 alone)."""

import json
import os
import sys

import torch
import torch.distributed as dist

import disttrain

disttrain.init()
total = torch.tensor([float(disttrain.rank())])
dist.all_reduce(total)  # sum of ranks 0..world-1
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
        "DISTTRAIN_SERVERS", "DISTTRAIN_TIMEOUT")
report = {k: os.environ.get(k) for k in keys}
report.update(
    rank=disttrain.rank(),
    world=disttrain.world_size(),
    role=disttrain.role(),
    sum=total.item(),
    argv=sys.argv[1:],
    name=__name__,
    secret=os.environ.get("DISTTRAIN_SECRET"),
    secret_in_cmdline=os.environ.get("DISTTRAIN_SECRET", "-") in open("/proc/self/cmdline").read(),
)
# NOTE: one write per line: under torchrun the ranks share one stdout pipe, and print()'s
# separate newline write lets two ranks' reports interleave on one line.
sys.stdout.write("REPORT " + json.dumps(report) + "\n")
sys.stdout.flush()
disttrain.shutdown()
