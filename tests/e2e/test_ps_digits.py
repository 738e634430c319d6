"""examples/digits_ps.py in every consistency mode, launched as a user would:

    disttrain run --workers 2 --servers 1 examples/digits_ps.py --mode MODE ...

Each run must end with `final test accuracy: 0.9xxx` and the server's report line.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_launcher import clean_env

ROOT = Path(__file__).resolve().parents[2]
ACCURACY = re.compile(r"final test accuracy: (0\.\d{4})")
CASES = {
    "sync": [],
    "ksync": ["--k", "1", "--straggler", "fixed:rank=1,delay=0.02"],
    "kbatch-sync": ["--k", "2", "--straggler", "exp:mean=0.01", "--lr", "0.1"],
    "async": ["--topk", "0.1"],  # top-k pushes with error feedback, through the CLI
    "kasync": ["--k", "1"],
    "kbatch-async": ["--k", "2"],
    "ssp": ["--staleness", "1"],
}


# NOTE: the fast suite runs the barrier end to end; the modes' rules (the K-batch with a
# straggler among them) are checked in tests/dist/test_ps_modes.py, test_ps_sync.py and
# tests/unit/test_ps_policy.py, and all seven run here with DISTTRAIN_SLOW=1 (suite time;
# kbatch-sync's accuracy also sat at 0.897 once on a loaded machine, 15 of 77 steps cancelled)
FAST = ("sync",)  # async runs end to end in tests/e2e/test_trace_report.py


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", [m if m in FAST else pytest.param(m, marks=pytest.mark.slow)
                                  for m in CASES])
def test_digits_ps_reaches_90_percent(mode):
    env = clean_env(OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "disttrain", "run", "--workers", "2", "--servers", "1",
           "examples/digits_ps.py", "--mode", mode, "--epochs", "4", *CASES[mode]]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=140)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}\n{out[-3000:]}"
    found = ACCURACY.findall(proc.stdout)
    assert found and float(found[-1]) >= 0.90, out[-3000:]
    assert "[ps server0]" in out and "lost workers []" in out, out[-3000:]
