"""A pipeline stage waiting in its bubble leaves its core to the others: on a machine its
ranks share, a pp > 1 layout is priced at the slowdown of the ranks that compute at once
on average (`LayerProfile.computing`), not of every rank."""

from __future__ import annotations

import dataclasses
import json

import pytest

from disttrain.plan import cost
from disttrain.plan.devices import device
from disttrain.plan.gpt import parse_gpt
from disttrain.plan.profiled import FORMAT, load_profile

TINY = "gpt:layers=4,hidden=64,heads=4,seq=64,vocab=128"
GPT = parse_gpt(TINY)
SHARED = {"2": 1.0, "4": 2.5, "8": 4.0}
"""Measured slowdowns of N copies at once (`plan profile --ranks`), as on 2 cores."""


def _device(tmp_path, shared: dict):
    rows = [{"name": "embed", "kind": "Embed", "forward_s": 1e-4, "backward_s": 1e-4},
            *({"name": f"blocks.{i}", "kind": "Block", "forward_s": 0.01, "backward_s": 0.02}
              for i in range(4)),
            {"name": "head", "kind": "Head", "forward_s": 0.002, "backward_s": 0.004}]
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"format": FORMAT, "device": "cpu", "threads": 1, "cpus": 2,
                                "steps": 3, "batch": 4, "seq": 64, "gpt": TINY, "layers": rows,
                                "shared": shared}))
    return dataclasses.replace(device("cpu-here"), profile=load_profile(str(path), GPT))


def _lay(pp: int, dp: int, schedule: str = "gpipe", m: int = 4) -> cost.Layout:
    return cost.Layout(pp=pp, dp=dp, tp=1, zero=0, micro_batch=4, microbatches=m,
                       schedule=schedule if pp > 1 else "-", recompute=False, sp=False,
                       precision="fp32")


@pytest.mark.timeout(10)
def test_computing_interpolates_the_measured_slowdowns(tmp_path):
    p = _device(tmp_path, SHARED).profile.shared(4)
    assert p.share == 2.5 and p.ranks == 4
    assert p.computing(1.0).share == 2.5
    assert p.computing(0.75).share == pytest.approx(1.0 + 1.5 * (3 - 2) / 2)  # 3 copies
    assert p.computing(0.25).share == 1.0 and p.computing(0.25).at_once == 1.0  # one at a time
    assert p.computing(0.0).share == 1.0


@pytest.mark.timeout(10)
def test_a_pipeline_is_priced_at_the_ranks_that_compute_at_once(tmp_path):
    dev = _device(tmp_path, SHARED)
    lay = _lay(2, 2)
    est = cost.estimate(GPT, lay, dev, 8)
    every = cost._estimate(GPT, lay, cost.rank_device(lay, dev), 8)  # all 4 at share 2.5
    busy = (every.step - every.bubble) / every.step
    assert 0.5 < busy < 1.0  # gpipe, 2 stages, 4 micro-batches: a bubble of about 1/5
    assert est.step < every.step
    # the bound the search prunes with stays below the estimate
    assert cost.lower_bound(GPT, lay, dev, 8) <= est.step * (1 + 1e-9)
    # more micro-batches, less bubble: closer to every rank computing at once
    more = _lay(2, 2, m=16)
    eased = cost.estimate(GPT, more, dev, 8).step
    full = cost._estimate(GPT, more, cost.rank_device(more, dev), 8).step
    assert (full - eased) / full < (every.step - est.step) / every.step


@pytest.mark.timeout(10)
def test_layouts_without_a_pipeline_or_a_measurement_are_priced_as_before(tmp_path):
    dev = _device(tmp_path, SHARED)
    lay = _lay(1, 4)
    assert cost.estimate(GPT, lay, dev, 8).step == cost._estimate(
        GPT, lay, cost.rank_device(lay, dev), 8).step
    plain = _device(tmp_path, {})  # no --ranks: the sharing formula, unchanged
    lay = _lay(2, 2)
    assert cost.estimate(GPT, lay, plain, 8).step == cost._estimate(
        GPT, lay, cost.rank_device(lay, plain), 8).step
