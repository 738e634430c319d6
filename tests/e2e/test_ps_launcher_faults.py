"""A parameter-server worker killed under `disttrain run`: the servers decide, not the agent.

Without supervision the elastic agent would stop every rank as soon as one dies, so an
asynchronous job could never outlive a lost worker. tests/dist/test_ps_faults.py checks
the servers' side with bare processes; this checks the launcher's.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "ps_kill_worker.py"


def launch(mode: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["DISTTRAIN_PS_TIMEOUT"] = "2"
    return subprocess.run(
        [sys.executable, "-m", "disttrain", "run", "--workers", "3", "--servers", "1",
         str(SCRIPT), mode], capture_output=True, text=True, timeout=100, env=env)


@pytest.mark.timeout(120)
def test_async_job_outlives_a_killed_worker():
    res = launch("async")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "worker rank 1 was killed (SIGKILL); the job goes on" in out, out
    assert "worker 0 finished" in out and "worker 2 finished" in out, out
    assert "lost workers [1]" in out, out


@pytest.mark.timeout(120)
def test_sync_job_stops_naming_the_killed_worker():
    res = launch("sync")
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert "worker 1 was lost" in out, out
