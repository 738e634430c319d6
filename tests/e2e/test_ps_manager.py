"""`disttrain ps status` against the manager of a job that `disttrain run --servers` runs:

    DISTTRAIN_SECRET=... disttrain run --workers 2 --servers 2 tests/e2e/scripts/ps_status_job.py DIR &
    DISTTRAIN_SECRET=... disttrain ps status ADDR

While the workers train, the status names both real servers (their ipc:// addresses, the
ones the servers bound), every key of the model on the server that holds it, their load
from heartbeats and ring version 2; with another secret it fails with a clear error in
bounded time. At the end the manager reports both servers exited.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from disttrain.ps.placement import plan_keys
from tests.e2e.test_launcher import clean_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "e2e" / "scripts" / "ps_status_job.py"
# the keys of ps_status_job.py's model on 2 servers, as every rank computes them (placement.py:
# tensors cut into ranges, so the status lists e.g. 0.weight#3)
KEYS = [c.key for keys in plan_keys([("0.weight", 512, 4), ("0.bias", 32, 4), ("2.weight", 128, 4),
                                     ("2.bias", 4, 4)], 2) for c in keys]


def _status(addr: str, env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "disttrain", "ps", "status", addr],
                          env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ps_status_prints_the_real_servers_and_keys_while_a_job_runs(tmp_path):
    env = clean_env(OMP_NUM_THREADS="1", DISTTRAIN_SECRET=secrets.token_hex(32))
    job = subprocess.Popen([sys.executable, "-m", "disttrain", "run", "--workers", "2",
                            "--servers", "2", str(SCRIPT), str(tmp_path)], cwd=ROOT, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(job.stdout), daemon=True)
    reader.start()
    try:
        end = time.monotonic() + 150
        while not all((tmp_path / f"trained{r}").exists() for r in (0, 1)):
            assert job.poll() is None and time.monotonic() < end, "".join(lines)[-3000:]
            time.sleep(0.2)
        text = "".join(lines)
        addr = re.search(r"\[ps manager\] ring version 0 \(0 servers\) at (\S+),", text).group(1)
        status = _status(addr, env)
        assert status.returncode == 0, status.stderr
        out = status.stdout
        assert "ring version 2: 2 of 2 servers alive" in out, out
        servers = re.findall(r"^\s+(\d)\s+alive\s+(\d+)\s+\S+\s+(\d+)\s+(\d+)\s+\S+\s+\S+s\s+(ipc://\S+)$",
                             out, re.M)
        assert [s[0] for s in servers] == ["0", "1"], out
        assert sum(int(s[1]) for s in servers) == len(KEYS), out
        assert any(int(s[3]) > 0 for s in servers), out  # pushes from the heartbeats
        for key in KEYS:
            assert re.search(rf"^  {re.escape(key)}\s+\S+ MB  server \d  chain \d$", out, re.M), out
        for s in servers:  # the addresses the servers really bound
            assert s[4] in text or os.path.exists(s[4].removeprefix("ipc://")), (s, out)
        start = time.monotonic()
        bad = _status(addr, dict(env, DISTTRAIN_SECRET=secrets.token_hex(32)))
        assert bad.returncode == 1 and "another DISTTRAIN_SECRET" in bad.stderr, bad.stderr
        assert time.monotonic() - start < 40
    finally:
        (tmp_path / "finish").touch()
        rc = job.wait(90)
        reader.join(10)
    text = "".join(lines)
    assert rc == 0, text[-3000:]
    assert "[ps manager] stopped at ring version 2: server 0 exited, server 1 exited" in text, text[-3000:]
