"""Elastic recovery, data parallel: `disttrain run --max-restarts 1` with a worker that
SIGKILLs itself mid-run restarts the group from the last checkpoint, and the final
parameters equal those of an uninterrupted run, bitwise.

The training script is written by the test (DataParallel, dropout, shuffled shard_loader,
a checkpoint every 3 steps); rank 1 kills itself at step 7 of the first attempt, after
the save at step 6 and before the one at step 9.
"""

import os
import subprocess
import sys

import pytest
import safetensors.torch
import torch

SCRIPT = '''
import os, signal, sys
import safetensors.torch, torch
from torch import nn
import disttrain

ckpt_dir, out, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
TOTAL = 14
disttrain.init()
torch.manual_seed(0)
model = disttrain.DataParallel(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3),
                                             nn.Linear(16, 2)))
opt = torch.optim.AdamW(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(0)
data = list(zip(torch.randn(24, 6, generator=g), torch.randint(0, 2, (24,), generator=g)))
loader = disttrain.data.shard_loader(data, 4, seed=3, generator=torch.Generator())
ckpt = disttrain.Checkpointer(ckpt_dir)
step = ckpt.load(model=model, optimizer=opt, loader=loader)
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
disttrain.print0(f"attempt {attempt} starts at step {step}")
while step < TOTAL:
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        step += 1
        if step % 3 == 0:
            ckpt.save(step, model=model, optimizer=opt, loader=loader)
        if attempt == 0 and disttrain.rank() == 1 and step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == TOTAL:
            break
if disttrain.rank() == 0:
    safetensors.torch.save_file({k: v.contiguous() for k, v in model.module.state_dict().items()}, out)
'''

LEAKY = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
         "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


def _run(tmp_path, name: str, kill_at: int) -> tuple[subprocess.CompletedProcess, dict]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / f"{name}.safetensors"
    env = {k: v for k, v in os.environ.items() if k not in LEAKY}
    res = subprocess.run(
        [sys.executable, "-m", "disttrain", "run", "--nproc", "2", "--max-restarts", "1",
         str(script), str(tmp_path / f"ckpt-{name}"), str(out), str(kill_at)],
        capture_output=True, text=True, timeout=100, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    return res, safetensors.torch.load_file(str(out))


@pytest.mark.timeout(120)
def test_sigkilled_worker_restarts_from_checkpoint_and_matches(tmp_path):
    straight, expected = _run(tmp_path, "straight", kill_at=0)
    assert "attempt 0 starts at step 0" in straight.stdout
    assert "attempt 1" not in straight.stdout
    killed, got = _run(tmp_path, "killed", kill_at=7)
    assert "attempt 0 starts at step 0" in killed.stdout
    assert "attempt 1 starts at step 6" in killed.stdout, killed.stdout + killed.stderr
    assert got.keys() == expected.keys()
    for k in expected:
        assert torch.equal(got[k], expected[k]), k
