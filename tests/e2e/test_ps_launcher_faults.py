"""A parameter-server worker killed under `disttrain run`: the servers decide, not the agent.

Without supervision the elastic agent would stop every rank as soon as one dies, so an
asynchronous job could never outlive a lost worker. tests/dist/test_ps_faults.py checks
the servers' side with bare processes; this checks the launcher's. Either way the job leaves nothing in the temporary folder
(its ranks' ipc folders and takeover files, SIGTERMed or SIGKILLed ranks included).
"""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "ps_kill_worker.py"


def launch(mode: str) -> subprocess.CompletedProcess:
    """The job's result; fails if it left a disttrain-* name in its temporary folder."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    # NOTE: a short private TMPDIR (an ipc:// path must fit 107 bytes), not /tmp, which
    # other jobs on the machine fill at the same time
    tmp = tempfile.mkdtemp(prefix="dt-")
    env.update(DISTTRAIN_PS_TIMEOUT="2", TMPDIR=tmp)
    try:
        res = subprocess.run(
            [sys.executable, "-m", "disttrain", "run", "--workers", "3", "--servers", "1",
             str(SCRIPT), mode], capture_output=True, text=True, timeout=100, env=env)
        left = sorted(n for n in os.listdir(tmp) if n.startswith("disttrain-"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert not left, f"left in TMPDIR: {left}\n{res.stdout}{res.stderr}"
    return res


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
