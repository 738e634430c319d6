"""A server killed while keys move to it (ps/transfer.py), on real processes.

2 workers, 3 servers, replicas=2, Sync: the new tail Y SIGKILLs itself on the first
`transfer` frame. No rank hangs: within the timeout (2 s) and its checks the sending
tail names Y as the replica it waits for, every worker's error names the server it
waited on, and every rank exits (ranks are plain subprocesses with a TCPStore, as in
tests/dist/test_ps_faults.py). No replica takes over yet: the job stops, naming who.

NOTE: slow (five processes that import torch, about 30 s on two loaded cores); the fast
tier covers a silent copy with tests/unit/test_ps_replica.py.
"""

import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "e2e", "scripts", "ps_kill_new_tail.py")
W, S = 2, 3


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_server_killed_while_keys_move_to_it_is_named_and_nothing_hangs():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               WORLD_SIZE=str(W + S), LOCAL_WORLD_SIZE=str(W + S), DISTTRAIN_SERVERS=str(S),
               DISTTRAIN_SECRET=secrets.token_hex(32), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), ROOT]))
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, SCRIPT], cwd=ROOT, text=True,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(W + S)]
    try:
        out = [(p.wait(timeout=120), p.stdout.read()) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    elapsed = time.monotonic() - t0
    tail, new = map(int, re.search(r"from server (\d) to server (\d)", out[W][1]).groups())
    assert out[W + new][0] == -signal.SIGKILL, out[W + new][1]
    code, text = out[W + tail]
    assert code == 1 and f"replica server {new} at ipc://" in text and "silent" in text, text
    for r in range(W):
        code, text = out[r]
        assert code == 1 and f"rank {r} stopped: worker {r} p" in text, text
        assert re.search(rf"server {new}\b", text), text
    for i in set(range(S)) - {new}:
        assert out[W + i][0] == 1 and "stopped" in out[W + i][1], out[W + i][1]
    assert elapsed < 100  # start-up, the timeout and its checks: never a hang
