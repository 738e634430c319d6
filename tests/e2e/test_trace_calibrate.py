"""A real traced run (2 ranks, gloo, examples/gpt_char.py with dp=2) read back two ways:
`disttrain report` says what bound its all-reduces from the cost inputs the trace header
recorded, and `disttrain plan layout --calibrate` takes its measured compute and
all-reduce times as inputs and predicts its step time (median) within a factor of 1.5."""

import json
import re
from pathlib import Path

import pytest

from tests.e2e.test_launcher import clean_env, disttrain

ROOT = Path(__file__).resolve().parents[2]
MODEL = "gpt:layers=2,hidden=64,heads=4,seq=64,vocab=128"  # gpt_char's GPTConfig below


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_traced_run_is_bound_by_the_model_and_calibrates_the_planner(tmp_path):
    out = tmp_path / "trace"
    env = {**clean_env(), "DISTTRAIN_STEP_US": "184"}
    res = disttrain("run", "--nproc", "2", "--trace", str(out), str(ROOT / "examples" / "gpt_char.py"),
                    "--dp", "2", "--steps", "8", "--n-layer", "2", "--log-every", "100",
                    "--sample-chars", "0", env=env, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    procs = json.loads((out / "trace.json").read_text())["otherData"]["processes"]
    assert all(p["cost"]["local_ranks"] == 2 and p["cost"]["step_us"] == 184.0 for p in procs), procs
    rep = disttrain("report", str(out), timeout=120)
    assert rep.returncode == 0, rep.stderr
    said = [x for x in rep.stdout.splitlines() if x.startswith("all_reduce of 0.48 MB over 2 ranks is ")]
    assert said and "-bound in the cost model (ring: " in said[0], rep.stdout
    assert "cost inputs recorded in the trace: per-sender CPU time, ranks per node" in rep.stdout
    plan = disttrain("plan", "layout", "--model", MODEL, "--devices", "2", "--device", "cpu-here",
                     "--global-batch", "32", "--micro-batch", "8", "--pp", "1", "--tp", "1",
                     "--zero", "0", "--calibrate", str(out), "--explain", timeout=60)
    assert plan.returncode == 0, plan.stderr
    assert "layer compute (traced)" in plan.stdout and "all-reduce inside a node: alpha" in plan.stdout
    predicted = float(re.search(r"winner: .*: step ([0-9.e-]+) s", plan.stdout).group(1))
    measured = float(re.search(r"measured step time \(median\): ([0-9.e+-]+) ms", plan.stdout).group(1)) / 1e3
    print(f"calibrated plan: predicted {predicted * 1e3:.1f} ms, measured median {measured * 1e3:.1f} ms")
    assert 1 / 1.5 < predicted / measured < 1.5, (predicted, measured)
