"""The planner prices what a layout's collectives really move: fp32 or bf16 elements, and
the data-parallel all-reduce by the algorithm the job runs (comm/cost.py's steps)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from disttrain.comm.cost import predict, predict_collective
from disttrain.plan import cost
from disttrain.plan.devices import device
from disttrain.plan.gpt import parse_gpt

GPT_1B = parse_gpt("gpt:layers=24,hidden=2048,heads=16,seq=2048,vocab=51200")
A100 = device("a100-80gb")


def _lay(**kw) -> cost.Layout:
    base = dict(pp=2, dp=4, tp=2, zero=0, micro_batch=1, microbatches=4, schedule="1f1b",
                recompute=False, sp=False)
    return cost.Layout(**{**base, **kw})


@pytest.mark.timeout(10)
def test_fp32_moves_twice_the_bytes_of_bf16():
    bf16, fp32 = _lay(), _lay(precision="fp32")
    wire = {p: {t.name: t.value for t in cost.estimate(GPT_1B, lay, A100, 8).wire}
            for p, lay in (("bf16", bf16), ("fp32", fp32))}
    for name in ("tp collectives", "pipeline sends", "data parallel"):
        assert wire["fp32"][name] == pytest.approx(2 * wire["bf16"][name]), name
    d16, d32 = (cost.action_times(GPT_1B, lay, A100, 8) for lay in (bf16, fp32))
    assert d32["p2p_bytes"] == 2 * d16["p2p_bytes"] == 4 * 2048 * 2048  # 4bsh, b = 1
    # 4 of 8 devices per node: the tp pair shares a node, the send crosses to the next
    h, s = 2048, 2048
    assert d32["p2p"] == pytest.approx(predict_collective("p2p", 4 * s * h, 2, 1, A100.links()))
    assert d32["F"] > d16["F"]  # the tp all-reduces of 4bsh bytes take longer


@pytest.mark.timeout(10)
def test_the_dp_all_reduce_is_priced_by_the_jobs_algorithm():
    m = parse_gpt("gpt:layers=4,hidden=1024,heads=8,seq=512,vocab=1000")
    lay = _lay(pp=1, dp=8, tp=1, schedule="-", microbatches=1)
    grads = 2 * (4 * m.layer_params + m.embed_params)
    k = math.ceil(grads / cost.BUCKET_BYTES)
    links = A100.links(nics=4)  # the dp group: 4 of its 8 ranks on each of 2 nodes
    by = {}
    for algo in ("native", "ring", "tree", "halving-doubling", "hierarchical"):
        est = cost.estimate(m, dataclasses.replace(lay, algorithm=algo), A100, 4)
        term = next(t for t in est.time if t.name.startswith("dp all-reduce"))
        by[algo] = term.value
        one = predict("ring" if algo == "native" else algo, grads / k, 8, 4, links)
        assert term.value >= one * (1 - 1e-9), algo  # at least the last bucket is exposed
        assert (f"[{algo}]" in term.name) == (algo not in ("native", "ring")), term.name
    assert by["native"] == by["ring"]
    assert len({round(v, 12) for v in by.values()}) >= 3, by  # the algorithms differ


def test_bad_precision_or_algorithm_says_what_to_give():
    with pytest.raises(ValueError, match="bf16, fp32"):
        _lay(precision="fp16")
    with pytest.raises(ValueError, match="native or one of ring"):
        _lay(algorithm="butterfly")


@pytest.mark.timeout(10)
def test_tp_prices_the_embedding_head_and_loss_collectives_too():
    # models/gpt.py's tp_plan: the vocab-parallel embedding all-reduces its output forward,
    # the column-parallel head its input's gradient backward, the vocab-parallel loss two
    # per-token fp32 values (4bs and 8bs bytes) forward; nothing more at pp = 1 (no bubble)
    m = parse_gpt("gpt:layers=2,hidden=256,heads=4,seq=128,vocab=512")
    here = device("cpu-here")
    lay = _lay(pp=1, dp=1, tp=2, schedule="-", micro_batch=4, microbatches=3, precision="fp32")
    est = cost.estimate(m, lay, here, 2)
    terms = {t.name: t.value for t in est.time}
    links = here.per_rank(2).links(nics=2)
    ar = predict_collective("all-reduce", 4 * 4 * 128 * 256, 2, 2, links)
    small = sum(predict_collective("all-reduce", k * 4 * 4 * 128, 2, 2, links) for k in (1, 2))
    assert terms["tp embedding, LM head and loss"] == pytest.approx(3 * (2 * ar + small))
    assert sum(terms.values()) == pytest.approx(est.step)  # each second counted once
    d = cost.action_times(m, lay, here, 2)
    assert d["emb_f"] == pytest.approx(ar) and d["head_comm"] == pytest.approx(ar + small)


@pytest.mark.timeout(10)
def test_zero_1_2_reduce_scatter_every_micro_batch_plain_dp_the_last():
    # DataParallel's no_sync holds the all-reduce to the last micro-batch; Zero stages 1-2
    # have none and reduce-scatter each micro-batch's gradients (parallel/zero/flat.py)
    m = parse_gpt("gpt:layers=4,hidden=1024,heads=8,seq=512,vocab=1000")
    reduce = {}
    for zero in (0, 1, 2):
        for mb in (1, 4):
            lay = _lay(pp=1, dp=4, tp=1, schedule="-", microbatches=mb, zero=zero)
            est = cost.estimate(m, lay, A100, 8)
            reduce[zero, mb] = next(t.value for t in est.time if t.name.startswith("dp "))
    assert reduce[0, 4] == pytest.approx(reduce[0, 1])
    for zero in (1, 2):
        assert reduce[zero, 4] == pytest.approx(4 * reduce[zero, 1])
