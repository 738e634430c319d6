"""Faults on real processes: a worker SIGKILLed mid-training.

Async tolerates it (the others finish, the server reports the lost worker); Sync turns
it, within the configured timeout, into an error that names the worker. Ranks are
plain subprocesses with a TCPStore (a killed rank must not take a test harness down).
"""

import os
import secrets
import signal
import socket
import subprocess
import sys
import time

import pytest

W, VICTIM, TIMEOUT = 3, 1, 2.0
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the job: worker VICTIM SIGKILLs itself at step 3 (shared with the launcher's e2e test)
SCRIPT = os.path.join(ROOT, "tests", "e2e", "scripts", "ps_kill_worker.py")


def _launch(mode: str):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               WORLD_SIZE=str(W + 1), LOCAL_WORLD_SIZE=str(W + 1), DISTTRAIN_SERVERS="1",
               DISTTRAIN_SECRET=secrets.token_hex(32), DISTTRAIN_PS_TIMEOUT=str(TIMEOUT),
               OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return [subprocess.Popen([sys.executable, SCRIPT, mode], cwd=ROOT, text=True,
                             env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            for r in range(W + 1)]


def _finish(procs, limit=60):
    try:
        return [(p.wait(timeout=limit), p.stdout.read()) for p in procs]
    finally:  # never leave ranks behind when a wait times out
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.timeout(90)
def test_async_survives_a_killed_worker_and_reports_it():
    out = _finish(_launch("async"))
    assert out[VICTIM][0] == -signal.SIGKILL
    for r in (0, 2):
        assert out[r][0] == 0 and f"worker {r} finished" in out[r][1], out[r][1]
    code, text = out[W]
    assert code == 0, text
    assert "lost workers [1]" in text, text


@pytest.mark.timeout(90)
def test_sync_names_the_lost_worker_within_the_timeout():
    t0 = time.monotonic()
    out = _finish(_launch("sync"))
    elapsed = time.monotonic() - t0
    code, text = out[W]
    assert code != 0 and "worker 1 was lost" in text, text
    for r in (0, 2):
        assert out[r][0] != 0 and "worker 1 was lost" in out[r][1], out[r][1]
    assert elapsed < 60  # bounded: timeout (2 s) plus process start-up, never a hang
