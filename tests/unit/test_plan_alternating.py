"""Ranks that block on a collective after every piece of compute (tp > 1, ZeRO-3 with the
cores full) are priced as plan/profile_sync.py's loop measured them (`LayerProfile.alternate`)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from disttrain.plan import cost
from disttrain.plan.devices import device
from disttrain.plan.gpt import parse_gpt
from disttrain.plan.profiled import FORMAT, load_profile

TINY = "gpt:layers=2,hidden=64,heads=4,seq=64,vocab=128"
GPT = parse_gpt(TINY)
INLINE = {"bytes": 262144, "inline_s": 0.004}
LOOP = {"both_s": 0.010, "call_s": 0.006, "compute_cpu_s": 0.002}
"""The loop: 10 ms per iteration, 6 of them in the all-reduce call, for 2 ms of compute CPU:
compute between the calls ran (10 - 6) / 2 = 2x slower than alone."""


def _profile(tmp_path, collectives: dict, name: str) -> str:
    rows = [{"name": "embed", "kind": "Embed", "forward_s": 1e-4, "backward_s": 1e-4},
            *({"name": f"blocks.{i}", "kind": "Block", "forward_s": 0.01, "backward_s": 0.02}
              for i in range(2)),
            {"name": "head", "kind": "Head", "forward_s": 0.002, "backward_s": 0.004}]
    path = tmp_path / name
    path.write_text(json.dumps({"format": FORMAT, "device": "cpu", "threads": 1, "cpus": 1,
                                "steps": 3, "batch": 4, "seq": 64, "gpt": TINY, "layers": rows,
                                "shared": {"2": 1.5}, "collectives": collectives}))
    return str(path)


def _devices(tmp_path):
    here = device("cpu-here")
    old = load_profile(_profile(tmp_path, {"2": INLINE}, "old.json"), GPT)
    new = load_profile(_profile(tmp_path, {"2": {**INLINE, **LOOP}}, "new.json"), GPT)
    return dataclasses.replace(here, profile=old), dataclasses.replace(here, profile=new)


def _lay(tp: int, dp: int, zero: int = 0) -> cost.Layout:
    return cost.Layout(pp=1, dp=dp, tp=tp, zero=zero, micro_batch=4, microbatches=2,
                       schedule="-", recompute=False, sp=False, precision="fp32")


def _terms(lay, dev) -> dict:
    return {t.name: t.value for t in cost.estimate(GPT, lay, dev, 8).time}


@pytest.mark.timeout(10)
def test_tensor_parallel_ranks_compute_and_wait_as_the_loop_measured(tmp_path):
    old, new = _devices(tmp_path)
    a, b = _terms(_lay(2, 1), old), _terms(_lay(2, 1), new)
    # compute: the loop's 2x, not the 1.5x of copies that never block
    assert b["layer compute (profiled)"] == pytest.approx(a["layer compute (profiled)"] * 2.0 / 1.5)
    # each blocking all-reduce: the loop's 6 ms call in place of the 4 ms inline measurement
    calls = 2 * 2 * 4  # micro-batches x layers x all-reduces per layer
    assert b["tp all-reduce"] - a["tp all-reduce"] == pytest.approx(calls * 0.002)
    rank = cost.rank_device(_lay(2, 1), new)
    assert rank.profile.alternating and cost.blocking_extra(rank) == pytest.approx(
        cost.blocking_extra(cost.rank_device(_lay(2, 1), old)) + 0.002)


@pytest.mark.timeout(10)
def test_data_parallel_ranks_keep_the_copies_slowdown_and_zero3_alternates(tmp_path):
    old, new = _devices(tmp_path)
    assert _terms(_lay(1, 2), new) == pytest.approx(_terms(_lay(1, 2), old))  # compute, then one bucket
    assert not cost.rank_device(_lay(1, 2), new).profile.alternating
    # ZeRO-3 on full cores blocks on each unit's gather after each module's compute, and
    # on each unit's reduce-scatter in the backward
    a, b = _terms(_lay(1, 2, 3), old), _terms(_lay(1, 2, 3), new)
    assert b["layer compute (profiled)"] == pytest.approx(a["layer compute (profiled)"] * 2.0 / 1.5)
    assert b["ZeRO-3 gathers (exposed)"] - a["ZeRO-3 gathers (exposed)"] == pytest.approx(
        2 * (2 * 3 * cost.UNITS + 3 * cost.ENDS) * 0.002)  # micro-batches x (layers x (fwd
    # gather + bwd gather + bwd reduce-scatter) x units + the same 3 of the embeddings',
    # final LayerNorm's and head's units)


@pytest.mark.timeout(10)
def test_a_loop_that_does_not_add_up_says_how_to_fix(tmp_path):
    for bad in ({"call_s": 0.02}, {"compute_cpu_s": 0}, {"both_s": "inf", "call_s": 0.001}):
        path = _profile(tmp_path, {"2": {**INLINE, **LOOP, **bad}}, "bad.json")
        with pytest.raises(ValueError, match="plan profile --ranks"):
            load_profile(path, GPT)
