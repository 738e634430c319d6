"""`disttrain plan layout`'s recommendation in words follows its inputs: memory, link rate."""

from __future__ import annotations

import dataclasses

import pytest

from disttrain import cli
from disttrain.plan.devices import device
from disttrain.plan.gpt import parse_gpt
from disttrain.plan.layout import Pins, plan_layouts
from disttrain.plan.recommend import loss_kind, recommend_layout

A100 = device("a100-80gb")
GPT_7B = parse_gpt("gpt:layers=32,hidden=4096,heads=32,seq=2048,vocab=51200")


def _say(m, dev, n, nodes_of, batch):
    plan = plan_layouts(m, dev, n, nodes_of, batch)
    flat = plan_layouts(m, dev, n, nodes_of, batch, Pins(tp=1, pp=1), top=1).ranked
    return plan, recommend_layout(m, dev, n, nodes_of, plan, flat[0] if flat else None)


@pytest.mark.timeout(20)
def test_a_model_that_fits_gets_data_parallel_and_one_grown_past_the_device_does_not():
    small = parse_gpt("gpt:layers=12,hidden=768,heads=12,seq=1024,vocab=50257")
    plan, text = _say(small, A100, 8, 8, 64)
    assert (plan.ranked[0].layout.pp, plan.ranked[0].layout.tp) == (1, 1)
    assert "model states 1.99 GB fit one a100-80gb device: data parallel (ZeRO-1 over dp 8" in text
    assert "the fastest layout that fits is dp 8 " in text
    # the same family grown (hidden 768 -> 4096, 12 -> 32 layers): 107 GB of states
    grown = parse_gpt("gpt:layers=32,hidden=4096,heads=32,seq=1024,vocab=50257")
    _, big = _say(grown, A100, 8, 8, 64)
    assert "do not fit one a100-80gb device (72.1 GB usable): ZeRO-3 over 2 devices or tp 2" in big
    assert "data parallel (ZeRO-1" not in big
    # GPT-3 175B on 1024 devices: nothing short of tp inside a node with pp, or ZeRO-3 wide
    gpt3 = parse_gpt("gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200")
    huge = recommend_layout(gpt3, A100, 1024, 8, plan_layouts(gpt3, A100, 1024, 8, 1536, top=3))
    assert "model states 2,794 GB do not fit" in huge
    assert "ZeRO-3 over 39 devices or tp 8 inside a node x pp 6" in huge
    # NOTE: ZeRO-2 reduce-scatters every one of the 96 micro-batches (no no_sync): plain dp wins
    assert "the fastest layout that fits is pp 16 x tp 8 x dp 8 " in huge


@pytest.mark.timeout(20)
def test_a_slower_inter_node_link_moves_the_answer_off_data_parallel_and_says_communication():
    _, fast = _say(GPT_7B, A100, 16, 4, 64)
    slow_dev = dataclasses.replace(A100, inter_Bps=A100.inter_Bps / 20)
    plan, slow = _say(GPT_7B, slow_dev, 16, 4, 64)
    assert "the fastest layout that fits is dp 16 (ZeRO-3" in fast
    assert "pure data parallel" not in fast  # it is the winner
    win = plan.ranked[0].layout
    assert win.dp < 16 and win.tp <= 4  # off dp-heavy, tp (if any) inside a node of 4
    assert "the fastest layout that fits is pp 8 x dp 2 " in slow
    lost = slow.split("pure data parallel (dp 16")[1]
    assert " on exposed communication: +3.5" in lost  # the all-gathers over a 20x slower link


def test_loss_kinds_are_the_cost_models_term_names():
    assert loss_kind("bubble (1f1b, pp=4, m=8)") == "bubble"
    for name in ("tp all-reduce", "pipeline p2p", "dp all-reduce (exposed)",
                 "ZeRO-3 gathers (exposed)", "ZeRO parameter all-gather"):
        assert loss_kind(name) == "exposed communication"
    assert loss_kind("matmul") == loss_kind("optimizer step") == "compute"


@pytest.mark.timeout(20)
def test_cli_prints_the_recommendation_under_the_table(capsys):
    argv = ["plan", "layout", "--model", "gpt:layers=12,hidden=768,heads=12,seq=1024,vocab=50257",
            "--devices", "8", "--device", "a100-80gb", "--global-batch", "64", "--top", "3"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("recommendation: model states 1.99 GB fit one a100-80gb device")


@pytest.mark.timeout(20)
def test_a_pinned_pipeline_is_won_on_the_bubble():
    m = parse_gpt("gpt:layers=24,hidden=2048,heads=16,seq=2048,vocab=51200")
    h100 = device("h100")
    plan = plan_layouts(m, h100, 16, 8, 64, Pins(pp=2), top=3)
    text = recommend_layout(m, h100, 16, 8, plan)
    assert "fit one h100 device: data parallel would do for memory" in text  # winner: pp 2
    assert "pp 2 x dp 8 (ZeRO-3, micro-batch 1, interleaved, m=8)" in text
    assert "it beats pp 2 x dp 8 (ZeRO-3, micro-batch 1, 1f1b, m=8)" in text
    assert text.endswith(" on bubble: +0.01092 s.")
