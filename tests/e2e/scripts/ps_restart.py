"""A parameter-server job whose server is SIGKILLed once, mid-run (run by disttrain run).

argv[1]: snapshot folder; argv[2]: "sync" or "async"; argv[3]: snapshot_every (0: none).
On the first attempt (TORCHELASTIC_RESTART_COUNT == "0") a thread on the server rank
watches the server's version side file and SIGKILLs the process once it passes KILL_AT;
the launcher restarts every rank, the server restores its snapshot and the workers
reconnect and train STEPS more steps.
"""

import os
import signal
import sys
import threading
import time

import torch

import disttrain
from disttrain import ps

KILL_AT, STEPS = 13, 20
folder, mode, every = sys.argv[1], sys.argv[2], int(sys.argv[3])
attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
disttrain.init()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
x, y = torch.randn(32, 4), torch.randn(32, 1) + 3.0
path = os.path.join(folder, "ps{server}.safetensors")


def kill_when_past(side: str) -> None:
    while True:
        try:
            with open(side, "rb") as f:  # "disttrain-ps job=<id> version=<v>" (ps/snapshot.py)
                if int(f.read(128).rpartition(b"=")[2].strip() or b"0") >= KILL_AT:
                    os.kill(os.getpid(), signal.SIGKILL)
        except (OSError, ValueError):
            pass
        time.sleep(0.002)


if disttrain.role() == "server" and attempt == "0":
    side = path.format(server=0) + ".version"
    threading.Thread(target=kill_when_past, args=(side,), daemon=True).start()

policy = ps.Async() if mode == "async" else ps.Sync()
conn = ps.connect(model, policy, optimizer=lambda p: torch.optim.SGD(p, lr=0.05),
                  snapshot=path, snapshot_every=every)  # servers serve here and exit
with torch.no_grad():
    initial = torch.nn.functional.mse_loss(model(x), y).item()
conn.pull().wait()
with torch.no_grad():
    start = torch.nn.functional.mse_loss(model(x), y).item()
for _ in range(STEPS):
    conn.pull().wait()
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    conn.push().wait()
    time.sleep(0.01)
conn.pull().wait()
with torch.no_grad():
    final = torch.nn.functional.mse_loss(model(x), y).item()
conn.close()
print(f"worker {disttrain.rank()} attempt {attempt}: loss {initial:.4f} at init, "
      f"{start:.4f} after connect, {final:.4f} after {STEPS} steps", flush=True)
disttrain.shutdown()
