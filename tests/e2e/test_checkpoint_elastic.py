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
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def train(ckpt):
    torch.manual_seed(0)
    model = disttrain.DataParallel(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3),
                                                 nn.Linear(16, 2)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    data = list(zip(torch.randn(24, 6, generator=g), torch.randint(0, 2, (24,), generator=g)))
    loader = disttrain.data.shard_loader(data, 4, seed=3, generator=torch.Generator())
    step = ckpt.load(model=model, optimizer=opt, loader=loader) if ckpt else 0
    disttrain.print0(f"attempt {attempt} {'resumable' if ckpt else 'straight'} run "
                     f"starts at step {step}")
    while step < TOTAL:
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            step += 1
            if ckpt and step % 3 == 0:
                ckpt.save(step, model=model, optimizer=opt, loader=loader)
            if ckpt and attempt == 0 and disttrain.rank() == 1 and step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if step == TOTAL:
                break
    return {k: v.contiguous() for k, v in model.module.state_dict().items()}


resumed = train(disttrain.Checkpointer(ckpt_dir))
straight = train(None)  # the uninterrupted reference, same processes and world size
if disttrain.rank() == 0:
    tensors = {**{"resumed/" + k: v for k, v in resumed.items()},
               **{"straight/" + k: v for k, v in straight.items()}}
    safetensors.torch.save_file(tensors, out)
'''

LEAKY = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
         "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


@pytest.mark.timeout(150)
def test_sigkilled_worker_restarts_from_checkpoint_and_matches(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "final.safetensors"
    env = {k: v for k, v in os.environ.items() if k not in LEAKY}
    res = subprocess.run(
        [sys.executable, "-m", "disttrain", "run", "--nproc", "2", "--max-restarts", "1",
         str(script), str(tmp_path / "ckpt"), str(out), "7"],
        capture_output=True, text=True, timeout=140, env=env)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log
    assert "attempt 0 resumable run starts at step 0" in res.stdout, log
    assert "attempt 1 resumable run starts at step 6" in res.stdout, log
    assert "attempt 1 straight run starts at step 0" in res.stdout, log
    final = safetensors.torch.load_file(str(out))
    names = [k.removeprefix("straight/") for k in final if k.startswith("straight/")]
    assert names and len(final) == 2 * len(names)
    for k in names:
        assert torch.equal(final[f"resumed/{k}"], final[f"straight/{k}"]), k
