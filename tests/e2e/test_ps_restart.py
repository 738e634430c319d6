"""A parameter server SIGKILLed mid-run under `disttrain run --max-restarts 1`.

The launcher restarts every rank; the server restores its last periodic snapshot
(`connect(..., snapshot=..., snapshot_every=N)`), reports how many updates the snapshot
lacked, the workers reconnect and the job finishes. The server kills itself from a
thread in the script (scripts/ps_restart.py) once its version side file passes 13.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "ps_restart.py"
KILL_AT, STEPS = 13, 20
RESTORED = re.compile(r"\[ps server0\] restored version (\d+) from \S+; (\d+) updates since "
                      r"that snapshot were lost \(the server had reached version (\d+)\)")
LOSSES = re.compile(r"worker (\d) attempt 1: loss ([\d.]+) at init, ([\d.]+) after connect, "
                    r"([\d.]+) after 20 steps")


def launch(folder: Path, mode: str, every: int) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["DISTTRAIN_PS_TIMEOUT"] = "3"
    res = subprocess.run(
        [sys.executable, "-m", "disttrain", "run", "--workers", "2", "--servers", "1",
         "--max-restarts", "1", str(SCRIPT), str(folder), mode, str(every)],
        capture_output=True, text=True, timeout=80, env=env)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    return out


def final_version(out: str) -> int:
    found = re.findall(r"\[ps server0\] \w+\(\): .* version (\d+), applied", out)
    assert len(found) == 1, out
    return int(found[0])


@pytest.mark.timeout(100)
@pytest.mark.parametrize("mode,every", [("sync", 5), pytest.param("async", 4, marks=pytest.mark.slow)])
def test_killed_server_restores_its_snapshot_and_reports_lost_updates(tmp_path, mode, every):
    out = launch(tmp_path, mode, every)
    m = RESTORED.search(out)
    assert m, out
    restored, lost, reached = map(int, m.groups())
    assert restored > 0 and restored % every == 0, out  # a periodic snapshot, not the start
    assert reached >= KILL_AT and lost == reached - restored and lost <= every, out
    assert f"restored version {restored} (lost updates {lost})" in out, out  # in the stats
    # the second attempt trains STEPS more steps from the restored version
    per_step = 1 if mode == "sync" else 2  # Sync: one update a round; Async: one a push
    assert final_version(out) == restored + STEPS * per_step, out
    losses = LOSSES.findall(out)
    assert sorted(w for w, *_ in losses) == ["0", "1"], out
    for _, init, start, final in losses:
        # the workers reconnect to trained parameters, and training goes on from there
        assert float(start) < float(init) and float(final) < float(start), out
    # atomic writes leave no temporary files behind
    assert sorted(os.listdir(tmp_path)) == ["ps0.safetensors", "ps0.safetensors.version"]


@pytest.mark.slow  # NOTE: suite time; the restore from a snapshot runs above
@pytest.mark.timeout(100)
def test_without_periodic_snapshots_the_restart_says_every_update_was_lost(tmp_path):
    out = launch(tmp_path, "sync", 0)
    m = re.search(r"found no snapshot at \S+; starting again from version 0: all (\d+) "
                  r"updates were lost \(the server had reached version (\d+)\)", out)
    assert m and m.group(1) == m.group(2) and int(m.group(1)) >= KILL_AT, out
    assert final_version(out) == STEPS, out
    assert "0.0000" not in out and len(LOSSES.findall(out)) == 2, out
