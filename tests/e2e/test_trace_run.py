"""`disttrain run --trace`: a crashed or interrupted job still leaves one valid trace."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from disttrain import trace
from tests.e2e.test_launcher import SCRIPTS, clean_env, disttrain

SCRIPT = str(SCRIPTS / "traced_dp.py")


def _steps(tr) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for e in tr["traceEvents"]:
        if e["ph"] == "X" and e["name"].startswith("step "):
            out.setdefault(e["pid"], set()).add(e["name"])
    return out


@pytest.mark.timeout(180)
def test_crashed_job_leaves_a_valid_merged_trace_of_the_window(tmp_path):
    res = disttrain("run", "--nproc", "2", "--trace", str(tmp_path), "--trace-steps", "1:10",
                    SCRIPT, "--steps", "8", "--crash-at", "4", timeout=170)
    assert res.returncode == 1 and "injected crash at step 4" in res.stderr, res.stderr
    assert "clocks of 2 ranks aligned to rank 0" in res.stderr and "residual error" in res.stderr
    assert "trace of 2 processes" in res.stderr and str(tmp_path / "trace.json") in res.stderr
    tr = json.loads((tmp_path / "trace.json").read_text())
    assert trace.problems(tr) == []
    # steps 1..3 closed on both ranks before rank 1 raised in step 4; step 0 is outside the window
    assert _steps(tr) == {0: {"step 1", "step 2", "step 3"}, 1: {"step 1", "step 2", "step 3"}}
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sorted((m["step"], m["rank"]) for m in lines) == [(s, r) for s in (1, 2, 3) for r in (0, 1)]


@pytest.mark.timeout(180)
def test_ctrl_c_leaves_a_valid_merged_trace(tmp_path):
    out = tmp_path / "trace"
    proc = subprocess.Popen(
        [sys.executable, "-m", "disttrain", "run", "--nproc", "2", "--trace", str(out), SCRIPT,
         "--steps", "8", "--hang-at", "3"],
        env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    seen = []
    try:
        deadline = time.monotonic() + 150
        while sum("waiting at step 3" in line for line in seen) < 2:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "".join(seen)
            seen.append(line)
            assert time.monotonic() < deadline, "".join(seen)
        time.sleep(1.0)  # NOTE: > the recorders' flush period (0.5 s)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and "trace of 2 processes" in rest, "".join(seen) + rest
    tr = json.loads((out / "trace.json").read_text())
    assert trace.problems(tr) == []
    assert _steps(tr) == {0: {"step 0", "step 1", "step 2"}, 1: {"step 0", "step 1", "step 2"}}
    assert Path(out / "metrics.jsonl").read_text().count("\n") == 6
