"""examples/hf_gpt2.py as a user runs it: an unmodified Hugging Face GPT-2, pipelined by
tracing on 2 processes under the launcher; the loss must go down."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.e2e.test_gpt_example import _run

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]


# NOTE: slow-marked for suite time: the traced HF GPT-2 pipeline is checked against one
# process, every schedule, in tests/dist/test_any_model.py.
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_hf_gpt2_example_traced_pipeline_lowers_loss():
    cmd = [sys.executable, "-m", "disttrain", "run", "--nproc", "2",
           str(ROOT / "examples" / "hf_gpt2.py"), "--pp", "2", "--steps", "12"]
    proc = _run(cmd, 110)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    first, last = map(float, re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", proc.stdout).groups())
    assert last < first - 0.5, proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hf_gpt2_example_pp_dp_tp_recompute_on_8_processes_lowers_loss():
    """Slow (8 processes import transformers and trace); DISTTRAIN_SLOW=1 runs it."""
    cmd = [sys.executable, "-m", "disttrain", "run", "--nproc", "8",
           str(ROOT / "examples" / "hf_gpt2.py"), "--pp", "2", "--dp", "2", "--tp", "2",
           "--recompute", "--steps", "12"]
    proc = _run(cmd, 590)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    first, last = map(float, re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", proc.stdout).groups())
    assert last < first - 0.5, proc.stdout
