"""Train a small model with DataParallel for STEPS steps; save a checkpoint only when
preempted (`disttrain.preempted()`), resume from it when started again (uses torch).

`preempt_train.py CKPT_DIR [STEPS [PAUSE]]`, PAUSE the seconds of sleep per step (default
0.05: a notice sent while training lands mid-run; 0 for runs nobody stops). Prints
`TRAINING` (rank 0) once every rank can take the notice, `PREEMPTED rank R step S` after
saving, `DONE rank R <sha256 of the parameters>` at the end. The data of step s depends
only on s and the rank, so a resumed run must end bitwise equal to one that was never
stopped.
"""

import hashlib
import sys
import time

import torch
from torch import nn

import disttrain

CKPT = sys.argv[1]
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 40
PAUSE = float(sys.argv[3]) if len(sys.argv) > 3 else 0.05

torch.set_num_threads(1)
disttrain.init()
rank = disttrain.rank()
torch.manual_seed(0)
model = disttrain.DataParallel(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)),
                               bucket_mb=0.001)  # several buckets; the flag rides the last
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
ckpt = disttrain.Checkpointer(CKPT)
start = ckpt.load(model=model, optimizer=opt)
if start:
    print(f"resumed at step {start}", flush=True)
disttrain.preempted()  # NOTE: the first call registers this rank for the notice
disttrain.comm.barrier()
if rank == 0:
    print("TRAINING", flush=True)
for step in range(start, STEPS):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    loss = ((model(x) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(PAUSE)
    if disttrain.preempted():
        ckpt.save(step + 1, model=model, optimizer=opt)
        print(f"PREEMPTED rank {rank} step {step + 1}", flush=True)
        break
else:
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    print(f"DONE rank {rank} {digest.hexdigest()}", flush=True)
disttrain.shutdown()
