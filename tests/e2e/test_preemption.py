"""Preemption: SIGTERM to `disttrain run` at a random moment of training; every rank
agrees on one step, saves one checkpoint, the job exits 143, and a second run resumes
and ends bitwise equal to a run that was never stopped (tests/e2e/scripts/preempt_train.py,
uses torch).

The fast suite runs one preempted job at world 2; DISTTRAIN_SLOW=1 adds world 4 and the
5-times loops at both worlds (DISTTRAIN_TEST_REPEAT changes how many).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest

from disttrain import Checkpointer
from tests.e2e.test_launcher import SCRIPTS, clean_env

SCRIPT = SCRIPTS / "preempt_train.py"
STEPS = "60"  # ~0.06 s each: the notice lands in training, well before its end
REPEAT = int(os.environ.get("DISTTRAIN_TEST_REPEAT", "5"))
LIMIT = 240  # seconds per launch on a loaded 2-core machine


def run(world: int, ckpt, *, stop_after: float | None = None) -> tuple[int, str]:
    """`disttrain run --nproc WORLD preempt_train.py CKPT`; with `stop_after`, SIGTERM to
    the launcher that many seconds after training started. (exit code, stdout+stderr).

    Only a run that is stopped sleeps between its steps (suite time: a run nobody stops
    ends with the same parameters without)."""
    pause = "0.05" if stop_after is not None else "0"
    proc = subprocess.Popen(
        [sys.executable, "-m", "disttrain", "run", "--nproc", str(world), "--grace-seconds", "60",
         str(SCRIPT), str(ckpt), STEPS, pause],
        env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        if stop_after is not None:
            for line in proc.stdout:
                seen.append(line)
                if line.strip() == "TRAINING":
                    break
            time.sleep(stop_after)
            proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=LIMIT)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, "".join(seen) + rest


def digests(out: str, world: int) -> set[str]:
    found = dict(re.findall(r"DONE rank (\d+) ([0-9a-f]{64})", out))
    assert sorted(found) == [str(r) for r in range(world)], out
    return set(found.values())


_reference: dict[int, str] = {}


def reference(world: int, tmp_path_factory) -> str:
    """The parameters' digest of a run never stopped (once per world)."""
    if world not in _reference:
        code, out = run(world, tmp_path_factory.mktemp(f"ref{world}"))
        assert code == 0, out
        (digest,) = digests(out, world)
        _reference[world] = digest
    return _reference[world]


def preempt_and_resume(world: int, ckpt, expected: str, stop_after: float) -> int:
    code, out = run(world, ckpt, stop_after=stop_after)
    assert code == 143, out
    assert f"told {world} rank(s) to save and stop" in out, out
    said = re.findall(r"PREEMPTED rank (\d+) step (\d+)", out)
    assert sorted(int(r) for r, _ in said) == list(range(world)), out
    steps = {int(s) for _, s in said}
    assert len(steps) == 1, f"the ranks stopped at different steps: {said}\n{out}"
    (step,) = steps
    assert 0 < step < int(STEPS), out
    assert Checkpointer(ckpt).steps() == [step], out  # exactly one checkpoint, of that step
    code, out = run(world, ckpt)
    assert code == 0, out
    assert f"resumed at step {step}" in out, out
    assert digests(out, world) == {expected}, out
    return step


@pytest.mark.timeout(4 * LIMIT)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_sigterm_saves_one_checkpoint_that_resumes_bitwise(world, tmp_path, tmp_path_factory):
    expected = reference(world, tmp_path_factory)
    preempt_and_resume(world, tmp_path / "ckpt", expected, random.uniform(0.0, 1.5))


@pytest.mark.slow
@pytest.mark.timeout((2 * REPEAT + 2) * LIMIT)
@pytest.mark.parametrize("world", [2, 4])
def test_sigterm_at_random_moments(world, tmp_path, tmp_path_factory):
    expected = reference(world, tmp_path_factory)
    rng = random.Random()
    stops = [preempt_and_resume(world, tmp_path / f"ckpt{i}", expected, rng.uniform(0.0, 1.5))
             for i in range(REPEAT)]
    print(f"world {world}: stopped at steps {stops}")


@pytest.mark.timeout(LIMIT)
def test_sigterm_without_a_rank_that_handles_it_stops_at_once(tmp_path):
    """A script that never calls disttrain.preempted() is stopped as before: no grace wait."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "disttrain", "run", "--nproc", "2", "--grace-seconds", "600",
         str(SCRIPTS / "sleeper.py"), str(tmp_path)],
        env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        while len(list(tmp_path.glob("*.pid"))) < 2:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=LIMIT)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, out
    assert time.monotonic() - start < 30, out  # the agent's stop, not the 600 s grace
    assert "got SIGTERM, stopped every rank" in out and "told" not in out, out
