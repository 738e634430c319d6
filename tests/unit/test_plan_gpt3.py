"""The seed's headline: GPT-3 175B on 1024 A100-80GB, `disttrain plan layout` beside the paper.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM" (SC'21, arXiv 2104.04473), sec. 5.1, "Estimating end-to-end training
time": GPT-3 (175B parameters: 96 layers, hidden 12288, 96 heads, sequence 2048,
vocabulary 51200) trained on T = 300B tokens with n = 1024 A100 GPUs and batch size 1536
achieves X = 140 teraFLOP/s per GPU (their FLOP count, eq. 3, includes activation
recomputation), so training takes about 34 days (8TP / nX). Their layout for it
(Megatron-LM's examples/pretrain_gpt3_175B.sh: 128 nodes of 8, tensor-parallel 8,
pipeline-parallel 16, micro-batch 1, global batch 1536, fp16, --checkpoint-activations;
1F1B, no sequence parallelism, which came in Korthikanti et al. 2022).
"""

from __future__ import annotations

import math
import time

import pytest

from disttrain.plan import cost, layout_memory
from disttrain.plan.devices import device
from disttrain.plan.gpt import parse_gpt
from disttrain.plan.layout import Pins, plan_layouts
from disttrain.plan.layout_text import days, throughput

PAPER_TFLOPS = 140e12
PAPER_DAYS = 34.0
GPT3 = parse_gpt("gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200")
A100 = device("a100-80gb")
PAPER_LAYOUT = Pins(tp=8, pp=16, zero=0, micro_batch=1, schedule="1f1b", recompute=True, sp=False)
PAPER_TECHNIQUES = Pins(zero=0, schedule="1f1b", recompute=True, sp=False)
"""What the paper's runtime ran: tp x pp x plain dp, 1F1B, full recompute, no SP (2022), no
ZeRO inside the 3-D layout (sec. 5 compares with ZeRO-3 as an alternative), no ZB-H1 (2023)."""


@pytest.mark.timeout(30)
def test_their_layout_is_predicted_within_25_percent_of_their_figures():
    est = plan_layouts(GPT3, A100, 1024, 8, 1536, PAPER_LAYOUT, top=1).ranked[0]
    tflops, train_days = throughput(GPT3, est, 1024, 1536), days(GPT3, est, 1536, 300e9)
    print(f"\nNarayanan et al. 2021: tp=8 pp=16: {PAPER_TFLOPS / 1e12:.0f} TFLOP/s per GPU, "
          f"{PAPER_DAYS:.0f} days; plan: {tflops / 1e12:.1f} TFLOP/s, {train_days:.1f} days")
    assert est.fits
    assert abs(tflops / PAPER_TFLOPS - 1) <= 0.25
    assert abs(train_days / PAPER_DAYS - 1) <= 0.25


@pytest.mark.timeout(30)
def test_the_planner_chooses_within_a_second_and_does_not_lose_to_their_layout():
    took = math.inf
    for _ in range(3):  # NOTE: each plan cold (caches cleared); the fastest of 3 counts, so
        for cached in (cost._collective, layout_memory.schedule_actions, layout_memory._held,
                       cost._simulated):
            cached.cache_clear()  # a burst of other load on the machine does not
        start = time.process_time()
        plan = plan_layouts(GPT3, A100, 1024, 8, 1536)
        took = min(took, time.process_time() - start)
    theirs = plan_layouts(GPT3, A100, 1024, 8, 1536, PAPER_LAYOUT, top=1).ranked[0]
    ours = plan.ranked[0]
    lay = ours.layout
    print(f"\nchosen: pp={lay.pp} dp={lay.dp} tp={lay.tp} zero={lay.zero} {lay.schedule} "
          f"recompute={lay.recompute} sp={lay.sp}: {throughput(GPT3, ours, 1024, 1536) / 1e12:.1f}"
          f" TFLOP/s, {days(GPT3, ours, 1536, 300e9):.1f} days ({took:.2f} s CPU)")
    assert ours.fits and ours.step <= theirs.step
    assert lay.pp * lay.dp * lay.tp == 1024 and lay.tp <= 8  # tensor parallel inside a node
    # NOTE: what keeps a plan under a second (0.7-0.9 s of CPU here) is branch and bound
    # pricing few layouts: 13 of 4,414 (a looser bound priced 60 and took 1.1-1.2 s); the
    # CPU time itself only guards against a blow-up (this machine is shared: docs/benchmarks.md)
    assert plan.visited <= 30, plan.visited
    assert took < 3.0


@pytest.mark.timeout(30)
def test_the_best_plan_with_the_papers_techniques_is_within_25_percent():
    est = plan_layouts(GPT3, A100, 1024, 8, 1536, PAPER_TECHNIQUES, top=1).ranked[0]
    lay = est.layout
    tflops, train_days = throughput(GPT3, est, 1024, 1536), days(GPT3, est, 1536, 300e9)
    print(f"\npaper's techniques: pp={lay.pp} dp={lay.dp} tp={lay.tp} {lay.schedule}: "
          f"{tflops / 1e12:.1f} TFLOP/s, {train_days:.1f} days, {est.memory / 1e9:.1f} GB")
    assert est.fits and est.memory <= A100.usable_bytes
    assert abs(tflops / PAPER_TFLOPS - 1) <= 0.25
    assert abs(train_days / PAPER_DAYS - 1) <= 0.25
