"""benchmarks/plan_accuracy.py's arithmetic: the error and per-group summary, Kendall's tau
over the pairs whose runs do not overlap, and the step times read from the example's log."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # NOTE: dataclasses resolve the module by name while loading
    spec.loader.exec_module(mod)
    return mod


pa = _load("plan_accuracy")


def test_error_is_predicted_over_the_median_of_the_runs():
    r = pa.Row("a", 2, predicted=0.11, runs=[0.30, 0.10, 0.09])
    assert r.measured == 0.10 and r.spread == pytest.approx(0.21)
    assert r.error == pytest.approx(0.10)


def test_paired_scoring_takes_the_median_of_each_rounds_error():
    # round r's run against round r's own prediction: errors +20%, -10%, +5% -> median +5%
    r = pa.Row("a", 2, predicted=1.0, runs=[1.0, 2.0, 4.0], paired=[1.2, 1.8, 4.2])
    p = r.as_paired()
    assert p.error == pytest.approx(0.05) and p.runs == r.runs
    assert r.error == pytest.approx(-0.5)  # the pooled prediction, unchanged
    # a case without per-round predictions (or a round that failed) keeps its pooled score
    assert pa.Row("b", 2, 1.0, [1.0, 2.0], paired=[1.0]).as_paired().error == pytest.approx(-1 / 3)


def test_summary_groups_by_processes_and_names_the_largest_error():
    rows = [pa.Row("a", 2, 1.1, [1.0, 1.0, 1.0]), pa.Row("b", 4, 0.7, [1.0, 1.0, 1.0]),
            pa.Row("c", 2, 2.0, [2.0, 2.0, 2.0]), pa.Row("d", 8, 3.3, [3.0, 3.0, 3.0]),
            pa.Row("e", 8, 9.9, [], failed="RuntimeError: x")]
    s = pa.summary(rows)
    small = s["groups"]["up to 4 processes"]
    assert small == {"cases": 3, "median": pytest.approx(0.1), "largest": pytest.approx(0.3)}
    assert s["groups"]["more than 4 processes"]["cases"] == 1  # the failed row is left out
    assert s["largest"][0] == "b" and s["largest"][1] == pytest.approx(-0.3)


def test_kendall_tau_counts_only_pairs_whose_runs_do_not_overlap():
    a = pa.Row("a", 2, 1.0, [1.0, 1.1, 0.9])
    b = pa.Row("b", 2, 2.0, [2.0, 2.1, 1.9])
    c = pa.Row("c", 2, 1.5, [3.0, 3.1, 2.9])  # predicted below b: one discordant pair
    d = pa.Row("d", 2, 9.0, [1.05, 1.0, 1.08])  # overlaps a: that pair is not counted
    tau, pairs = pa.kendall_tau([a, b, c, d])
    # counted: ab +, ac +, bc -, bd -, cd -  (ad overlaps)
    assert pairs == 5
    assert tau == pytest.approx((2 - 3) / 5)
    assert pa.kendall_tau([a, d]) == (None, 0)
    assert pa.kendall_tau([a, b, pa.Row("c2", 2, 3.0, [3.0])]) == (1.0, 3)


def test_step_times_come_from_the_cumulative_rate_lines():
    layouts = _load("_plan_accuracy_layouts")
    tokens = 1024
    ends = [0.5, 0.7, 0.9, 1.2]  # seconds since the loop began, after steps 1..4
    log = "\n".join(f"[rank0]: step {k:4d}  loss 3.100  ({k * tokens / t:,.0f} tokens/s)"
                    for k, t in enumerate(ends, 1))
    got = layouts.step_times(log + "\nloss 4.8 -> 3.1\n", tokens)
    assert got == pytest.approx([0.2, 0.2, 0.3], abs=3e-4)  # integer tokens/s: 1e-4 s here
