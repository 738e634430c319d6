"""The collectives every step of the runtime waits on outside the layers (plan/per_step.py)."""

from __future__ import annotations

import dataclasses

import pytest

from disttrain.comm.cost import predict_collective
from disttrain.plan import cost
from disttrain.plan.devices import device
from disttrain.plan.gpt import parse_gpt
from disttrain.plan.per_step import step_collectives

GPT = parse_gpt("gpt:layers=4,hidden=128,heads=4,seq=64,vocab=128")
HERE = device("cpu-here")


def _lay(pp: int, dp: int, tp: int = 1) -> cost.Layout:
    return cost.Layout(pp=pp, dp=dp, tp=tp, zero=0, micro_batch=8, microbatches=4,
                       schedule="1f1b" if pp > 1 else "-", recompute=False, sp=False,
                       precision="fp32")


def _term(est: cost.Estimate) -> float:
    return sum(t.value for t in est.time if t.name == "step barrier and loss")


@pytest.mark.timeout(10)
def test_a_pipeline_waits_on_a_barrier_and_the_loss_broadcast_and_dp_on_the_loss():
    def price(op, nbytes, world, local):
        return predict_collective(op, nbytes, world, local, HERE.links(nics=local))

    none, _ = step_collectives(1, 1, 1, 1, 0.0, price)
    assert none == 0.0
    pp, how = step_collectives(2, 1, 2, 1, 0.0, price)
    assert pp == pytest.approx(price("all-reduce", 4, 2, 2) + price("all-gather", 32, 2, 2))
    assert "barrier" in how and "broadcast" in how and "dp" not in how
    dp, how = step_collectives(1, 4, 1, 4, 0.0, price)
    assert dp == pytest.approx(price("all-reduce", 4, 4, 4)) and "loss all-reduce" in how
    # every one of them is a blocking collective: each pays the measured extra once
    both, how = step_collectives(2, 2, 2, 2, 1e-3, price)
    plain, _ = step_collectives(2, 2, 2, 2, 0.0, price)
    assert both - plain == pytest.approx(3e-3) and "1 ms measured" in how


@pytest.mark.timeout(10)
def test_the_step_includes_them_and_explain_shows_them():
    for pp, dp in ((2, 1), (1, 2), (2, 2)):
        lay = _lay(pp, dp)
        est = cost.estimate(GPT, lay, HERE, 8)
        fixed = _term(est)
        assert fixed > 0, (pp, dp)
        # the step is the pipeline's makespan, the exposed reduction, the optimizer and these
        rest = sum(t.value for t in est.time if t.name.startswith(("dp ", "optimizer")))
        d = cost.action_times(GPT, lay, HERE, 8)
        makespan, _ = cost._pipeline(lay, d)
        assert est.step == pytest.approx(makespan + rest + fixed, rel=1e-9), (pp, dp)
        assert cost.lower_bound(GPT, lay, HERE, 8) <= est.step * (1 + 1e-9)
    assert _term(cost.estimate(GPT, _lay(1, 1), HERE, 8)) == 0.0
    # across nodes the pipeline group's barrier crosses the slower link
    slow = dataclasses.replace(HERE, inter_Bps=HERE.inter_Bps / 100, inter_alpha=5e-3)
    assert _term(cost.estimate(GPT, _lay(2, 1), slow, 1)) > _term(cost.estimate(GPT, _lay(2, 1), slow, 2))


@pytest.mark.timeout(10)
def test_zb_h1_prices_the_w_that_walk_the_whole_graph_again():
    from disttrain.parallel.pipeline.schedules import make_schedule, simulate

    gpt = parse_gpt("gpt:layers=24,hidden=2048,heads=16,seq=2048,vocab=51200")
    a100 = device("a100-80gb")
    lay = cost.Layout(pp=2, dp=2, tp=1, zero=0, micro_batch=1, microbatches=4,
                      schedule="zb-h1", recompute=False, sp=False)
    d = cost.action_times(gpt, lay, a100, 8)
    sched = make_schedule("zb-h1", 2, 4)

    def rows(whole_first: bool, synced: bool):
        out = []
        for s, acts in enumerate(sched):
            last_w = max(i for i, a in enumerate(acts) if a.kind == "W")
            row = []
            for i, a in enumerate(acts):
                if a.kind == "F":
                    row.append(d["F"] + (d["p2p"] + d["head_f"] if s else d["emb_f"]))
                elif a.kind == "W":  # stage 0's input is token ids: its W is a whole backward
                    whole = (whole_first and s == 0) or (synced and i == last_w)
                    row.append(d["B"] if whole else d["W"])
                else:
                    own = 0.0 if whole_first and s == 0 else d["B_split"]
                    row.append(own + (d["p2p"] if s == 0 else d["head_b"]))
            out.append(row)
        return simulate(sched, 2, durations=out).makespan

    makespan, _ = cost._pipeline(lay, d)
    assert makespan == pytest.approx(rows(True, True), rel=1e-8)
    assert makespan > rows(True, False) and makespan != pytest.approx(rows(False, False))
    # one replica: no synced W, only the first stage's whole ones
    one, _ = cost._pipeline(dataclasses.replace(lay, dp=1), d)
    assert one == pytest.approx(rows(True, False), rel=1e-8)
