"""A parameter-server job whose worker 1 SIGKILLs itself at step 3 (run by disttrain run).

argv[1]: "async" or "sync".
"""

import os
import signal
import sys
import time

import torch

import disttrain
from disttrain import ps

disttrain.init()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
policy = ps.Async() if sys.argv[1] == "async" else ps.Sync()
conn = ps.connect(model, policy)  # servers serve here, print their report and exit
x, y = torch.randn(8, 4), torch.randn(8, 1)
for step in range(20):
    if disttrain.rank() == 1 and step == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    conn.pull().wait()
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    conn.push().wait()
    time.sleep(0.05)
conn.close()
print(f"worker {disttrain.rank()} finished", flush=True)
disttrain.shutdown()
