"""A worker waiting for a reply its live server never sends fails, naming what it waits
for, instead of hanging (scripts/ps_wait_forever.py: a KAsync(2) pull whose round needs
the push of a worker that waits at the script's barrier for this one; both beat).

Before worker_loop.py bounded such a wait (`WorkerLoop._unanswered`), this job hung
until it was killed: the server answers every beat, so the worker never saw it silent.
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

EXCEPTION = re.compile(r"^\[rank0\]: ([\w.]+(Error|Exception)): (.*)$", re.M)

SCRIPT = Path(__file__).parent / "scripts" / "ps_wait_forever.py"


def launch(servers: int, replicas: int) -> tuple[int, str]:
    """(exit code, output) of the job; a job that hangs is -1 with what it printed."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    tmp = tempfile.mkdtemp(prefix="dt-")  # NOTE: a short one: an ipc:// path fits 107 bytes
    env.update(DISTTRAIN_PS_TIMEOUT="2", DISTTRAIN_PS_WAIT="4", TMPDIR=tmp)
    try:
        res = subprocess.run([sys.executable, "-m", "disttrain", "run", "--workers", "2",
                              "--servers", str(servers), str(SCRIPT), str(replicas)],
                             capture_output=True, text=True, timeout=90, env=env)
    except subprocess.TimeoutExpired as e:
        return -1, f"{e}\n{e.stdout or ''}{e.stderr or ''}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return res.returncode, res.stdout + res.stderr


def first_error(out: str) -> str:
    """Rank 0's exception, checked to be the first failure `disttrain run` reports."""
    reports = re.findall(r"^disttrain run: rank \d+ (?:raised|also failed).*$", out, re.M)
    assert reports and reports[0].startswith("disttrain run: rank 0 raised an exception"), out
    found = EXCEPTION.search(out)
    assert found, out
    return f"{found.group(1)}: {found.group(3)}"


@pytest.mark.timeout(120)
def test_a_pull_a_live_server_never_answers_fails_naming_the_server_and_its_round():
    code, out = launch(1, 1)
    assert code not in (0, -1), out
    error = first_error(out)
    assert error.startswith("disttrain.ps.handle.PSError: worker 0 pull: server 0 at "), out
    assert ("answers beats but has not sent what worker 0 waits for in" in error
            and "the params of a version after 0 (pull) (under KAsync(k=2))" in error
            and "its open round (version 0) holds 1 of the 2 pushes that close it (from "
                "workers [0]), live workers [0, 1]" in error
            and "limit 4s (DISTTRAIN_PS_WAIT): raise it if" in error), out


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_same_with_two_servers_and_replicas():
    code, out = launch(2, 2)
    assert code not in (0, -1), out
    error = first_error(out)
    assert error.startswith("disttrain.ps.handle.PSError: worker 0 pull: server "), out
    assert "holds 1 of the 2 pushes that close it (from workers [0])" in error, out
