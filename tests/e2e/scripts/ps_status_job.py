"""A parameter-server job that trains until the test lets it finish (run by disttrain run).

argv[1]: a folder. Workers push and pull a small MLP and, after their first steps, write
`trained<rank>` there, then keep training until the file `finish` appears (at most 120 s),
so `disttrain ps status` can be run against the job's manager while it trains.
"""

import os
import sys
import time

import torch

import disttrain
from disttrain import ps

folder = sys.argv[1]
disttrain.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
conn = ps.connect(model, ps.Sync(), optimizer=lambda p: torch.optim.SGD(p, lr=0.05))
x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
end, step = time.monotonic() + 120, 0
while time.monotonic() < end and not os.path.exists(os.path.join(folder, "finish")):
    conn.pull().wait()
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    conn.push().wait()
    step += 1
    if step == 5:
        open(os.path.join(folder, f"trained{disttrain.rank()}"), "w").close()
    time.sleep(0.02)
conn.close()
print(f"worker {disttrain.rank()} trained {step} steps", flush=True)
