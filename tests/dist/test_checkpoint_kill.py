"""A process SIGKILLed in the middle of `save` never destroys the last good checkpoint.

A child process saves 4 MiB checkpoints in a loop (printing each committed step); the
test kills it with SIGKILL at chosen moments of a save (as soon as the temporary folder
appears, once its data file is being written, at a random instant), then loads in this
process: the newest committed checkpoint loads with no damage warning, its tensor is
the one saved with its step, and the next save clears the debris.
"""

import os
import random
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

from disttrain.checkpoint import Checkpointer, CheckpointWarning

SAVER = """
import sys, torch
from disttrain.checkpoint import Checkpointer
ckpt = Checkpointer(sys.argv[1], keep=2)
step = 0
while True:
    step += 1
    ckpt.save(step, extra={"w": torch.full((1024, 1024), float(step)), "step": step})
    print(step, flush=True)
"""


def _debris(folder: str) -> list[str]:
    return [n for n in os.listdir(folder) if n.startswith(".tmp-")]


def _kill_when(folder: str, moment: str) -> int:
    """Start the saver, wait for 2 commits, kill at `moment`; returns the last printed step."""
    os.makedirs(folder)
    child = subprocess.Popen([sys.executable, "-c", SAVER, folder], stdout=subprocess.PIPE,
                             text=True)
    try:
        printed = [int(child.stdout.readline()) for _ in range(2)]
        deadline = time.monotonic() + 20
        delay = random.Random(0).uniform(0.0, 0.08)
        start = time.monotonic()
        while time.monotonic() < deadline:
            tmp = _debris(folder)
            if moment == "tmp" and tmp:
                break
            if moment == "data" and tmp and os.listdir(os.path.join(folder, tmp[0])):
                break
            if moment == "random" and time.monotonic() - start > delay:
                break
            time.sleep(0.0002)
        else:
            pytest.fail(f"no save reached moment {moment!r} within 20 s")
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    assert child.returncode == -signal.SIGKILL
    return printed[-1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("moment", ["tmp", "data", "random"])
def test_sigkill_during_save_keeps_last_good(tmp_path, moment):
    for attempt in range(3):
        folder = str(tmp_path / str(attempt))
        last_printed = _kill_when(folder, moment)
        # A save may, rarely, finish between the poll that saw it and the kill: retry.
        if moment == "random" or _debris(folder):
            break
    else:
        pytest.fail(f"3 kills at moment {moment!r} all landed between saves")
    extra = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)  # nothing committed is damaged
        step = Checkpointer(folder).load(extra=extra, rng=False)
    assert step >= last_printed and extra["step"] == step
    assert torch.equal(extra["w"], torch.full((1024, 1024), float(step)))
    Checkpointer(folder, keep=2).save(step + 1, extra={"step": step + 1})
    assert not _debris(folder)
    assert Checkpointer(folder).load(extra=extra) == step + 1
