"""`disttrain plan layout`: its memory, bubble and link terms, its ranking, its CLI errors."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from disttrain import cli
from disttrain.comm.cost import Links, collective_bound, predict, predict_collective
from disttrain.parallel.pipeline.schedules import make_schedule, simulate
from disttrain.plan import cost
from disttrain.plan.devices import device
from disttrain.plan.gpt import parse_gpt
from disttrain.plan.layout import plan_layouts
from disttrain.plan.memory import model_state_bytes

SRC = Path(__file__).resolve().parents[2] / "src"
GPT_1B = parse_gpt("gpt:layers=24,hidden=2048,heads=16,seq=2048,vocab=51200")
GPT_7B = parse_gpt("gpt:layers=32,hidden=4096,heads=32,seq=2048,vocab=51200")
A100 = device("a100-80gb")


@pytest.mark.timeout(10)
def test_memory_terms_are_the_zero_formulas_plus_korthikanti_activations():
    lay = cost.Layout(pp=4, dp=2, tp=2, zero=2, micro_batch=2, microbatches=8,
                      schedule="1f1b", recompute=False, sp=False)
    terms = {t.name: t.value for t in cost.memory(GPT_1B, lay)}
    h, s, a, b, t = 2048, 2048, 16, 2, 2
    params = (24 // 4 * (12 * h * h + 13 * h) + (51200 + s) * h) / t  # stage 0's share
    assert terms["model states"] == pytest.approx(model_state_bytes(params, 2, 2, "adam", "mixed").total)
    per_layer = s * b * h * (10 + 24 / t) + 5 * a * s * s * b / t  # Korthikanti, Table 2
    assert terms["activations"] == pytest.approx(4 * 6 * per_layer)  # 1F1B stage 0 holds p = 4
    sp = dataclasses.replace(lay, sp=True)
    assert {x.name: x.value for x in cost.memory(GPT_1B, sp)}["activations"] == pytest.approx(
        4 * 6 * (34 * s * b * h / t + 5 * a * s * s * b / t))
    rc = dataclasses.replace(lay, recompute=True)
    assert {x.name: x.value for x in cost.memory(GPT_1B, rc)}["activations"] == pytest.approx(
        4 * 6 * 2 * s * b * h)  # full recompute keeps each layer's input


@pytest.mark.timeout(10)
def test_bubble_is_the_schedule_simulators():
    lay = cost.Layout(pp=4, dp=2, tp=1, zero=0, micro_batch=1, microbatches=8,
                      schedule="1f1b", recompute=False, sp=False)
    est = cost.estimate(GPT_1B, lay, A100, 8)
    d = cost.action_times(GPT_1B, lay, A100, 8)
    sched = make_schedule("1f1b", 4, 8)
    rows = [[(d["F"] + (d["p2p"] if s else 0) + (d["head_f"] if s == 3 else 0)) if a.kind == "F"
             else (d["B"] + (d["p2p"] if s < 3 else 0) + (d["head_b"] if s == 3 else 0))
             for a in acts] for s, acts in enumerate(sched)]
    sim = simulate(sched, 4, durations=rows)
    # NOTE: the planner's simulator cache keys durations at 9 significant digits, so the
    # bubble (a difference of makespans) agrees to 1e-8 of the makespan, not of itself
    assert est.bubble == pytest.approx(sim.makespan - max(map(sum, rows)), abs=1e-8 * sim.makespan)
    assert est.bubble > 0
    # a schedule with a smaller bubble (interleaved) gets a smaller one here too
    inter = cost.estimate(GPT_1B, dataclasses.replace(lay, schedule="interleaved"), A100, 8)
    assert 0 < inter.bubble < est.bubble


@pytest.mark.timeout(10)
def test_a_model_that_does_not_fit_one_device_is_not_plain_data_parallel():
    small = parse_gpt("gpt:layers=12,hidden=768,heads=12,seq=1024,vocab=50257")
    winner = plan_layouts(small, A100, 8, 8, 64).ranked[0].layout
    assert (winner.pp, winner.tp) == (1, 1)  # fits: data parallel (some ZeRO stage)
    # 6.5B params x 16 B = 104 GB of model states: no replica fits 80 GB
    plan = plan_layouts(GPT_7B, A100, 8, 8, 64, top=50)
    assert plan.ranked and plan.too_big > 0
    assert not [e for e in plan.ranked if (e.layout.pp, e.layout.tp, e.layout.zero) == (1, 1, 0)]
    assert all(e.fits for e in plan.ranked)


@pytest.mark.timeout(10)
def test_a_slower_link_makes_tensor_parallelism_across_nodes_worse():
    across = cost.Layout(pp=2, dp=1, tp=8, zero=0, micro_batch=1, microbatches=16,
                         schedule="1f1b", recompute=False, sp=False)
    inside = dataclasses.replace(across, pp=4, tp=4)
    slow = dataclasses.replace(A100, inter_Bps=A100.inter_Bps / 20)
    steps = {(d.inter_Bps, lay.tp): cost.estimate(GPT_7B, lay, d, 4).step
             for d in (A100, slow) for lay in (across, inside)}
    fast_gap = steps[(A100.inter_Bps, 8)] - steps[(A100.inter_Bps, 4)]
    slow_gap = steps[(slow.inter_Bps, 8)] - steps[(slow.inter_Bps, 4)]
    assert slow_gap > fast_gap + 1.0  # tp=8 on nodes of 4 pays the slow link every layer
    fast_win = plan_layouts(GPT_7B, A100, 16, 4, 64).ranked[0].layout
    slow_plan = plan_layouts(GPT_7B, slow, 16, 4, 64)
    assert slow_plan.ranked[0].layout != fast_win
    assert all(e.layout.tp <= 4 for e in slow_plan.ranked[:3])


@pytest.mark.timeout(10)
def test_collectives_share_comm_cost_model():
    links = Links(alpha=5e-6, link_Bps=24e9, local_alpha=2e-6, local_Bps=200e9)
    for world, local in ((8, 8), (16, 8), (8, 1)):
        ar = predict_collective("all-reduce", 64e6, world, local, links)
        assert ar == pytest.approx(predict("ring", 64e6, world, local, links))
        halves = [predict_collective(op, 64e6, world, local, links)
                  for op in ("reduce-scatter", "all-gather")]
        assert sum(halves) == pytest.approx(ar)
    assert predict_collective("p2p", 24e6, 2, 1, links) == pytest.approx(5e-6 + 1e-3)
    with pytest.raises(ValueError, match="no model for collective 'all-to-all'"):
        predict_collective("all-to-all", 1e6, 8, 8, links)


@pytest.mark.timeout(60)
def test_planner_imports_no_torch():
    # NOTE: disttrain/__init__.py imports torch for the library's face; the planner's own
    # modules (plan/, comm/cost.py, settings.py, pipeline/schedules.py) must not need it
    code = textwrap.dedent(f"""
        import importlib.abc, sys, types
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] == "torch":
                    raise ImportError("planner imported " + name)
        sys.meta_path.insert(0, Block())
        for pkg in ("disttrain", "disttrain.comm", "disttrain.parallel",
                    "disttrain.parallel.pipeline"):
            mod = types.ModuleType(pkg)
            mod.__path__ = [{str(SRC)!r} + "/" + pkg.replace(".", "/")]
            sys.modules[pkg] = mod
        import disttrain.plan.layout
        from disttrain.plan.layout import plan_layouts
        from disttrain.plan.devices import device
        from disttrain.plan.gpt import parse_gpt
        m = parse_gpt("gpt:layers=12,hidden=768,heads=12,seq=1024,vocab=50257")
        assert plan_layouts(m, device("a100-40gb"), 16, 8, 64).ranked
        assert not [n for n in sys.modules if n.split(".")[0] == "torch"]
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr


GPT3 = ["--model", "gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200",
        "--devices", "1024", "--device", "a100-80gb"]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt:layers=2,hidden=64"] + GPT3[2:], "missing heads=, seq=, vocab="),
    (["--model", "llama:layers=2"] + GPT3[2:], "must look like gpt:"),
    (GPT3[:2] + ["--devices", "0", "--device", "a100-80gb"], "--devices must be >= 1"),
    (GPT3[:4] + ["--device", "tpu"], "unknown device 'tpu'"),
    (GPT3 + ["--zero", "5"], "--zero must be 0, 1, 2 or 3"),
    (GPT3[:2] + ["--devices", "1", "--device", "a100-40gb"], "no layout fits 1 x a100-40gb"),
    (GPT3[:2] + ["--devices", "12", "--device", "a100-40gb"], "must be whole nodes"),
    (GPT3 + ["--tp", "8", "--pp", "16", "--global-batch", "3"], "divides --global-batch 3"),
    (["--model", "gpt:layers=2,hidden=66,heads=4,seq=8,vocab=10"] + GPT3[2:],
     "must be a multiple of heads"),
])
def test_cli_errors_say_what_to_fix(capsys, argv, message):
    assert cli.main(["plan", "layout", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.timeout(20)
def test_cli_table_and_explain(capsys):
    argv = ["plan", "layout", "--model", "gpt:layers=24,hidden=2048,heads=16,seq=2048,vocab=51200",
            "--devices", "16", "--device", "h100", "--global-batch", "64", "--tokens", "1e9",
            "--top", "3", "--pp", "2", "--explain"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count(" days") == 3 and "winner: " in out and "runner-up: " in out
    for source in ("Bekman", "datasheet", "Korthikanti", "schedule simulator", "comm/cost.py",
                   "bytes one device sends per step:", "MFU = 72 B s l h^2"):
        assert source in out


@pytest.mark.timeout(10)
def test_ranks_of_this_machine_share_it_and_its_cpu_pool():
    here = device("cpu-here")
    quarter = here.per_rank(4)
    assert quarter.peak_flops["bf16"] == pytest.approx(here.peak_flops["bf16"] / 4)
    assert quarter.memory_bytes == pytest.approx(here.memory_bytes / 4)
    assert A100.per_rank(8) is A100  # GPUs are devices of their own
    links = here.links()
    assert links.shared_cpu and links.step_alpha > 0  # comm/cost.py's emulated-cluster fit
    tiny = parse_gpt("gpt:layers=4,hidden=64,heads=4,seq=64,vocab=128")
    lay = cost.Layout(pp=1, dp=2, tp=1, zero=0, micro_batch=4, microbatches=1,
                      schedule="-", recompute=False, sp=False)
    two, four = (cost.estimate(tiny, dataclasses.replace(lay, dp=n), here, 8) for n in (2, 4))
    assert four.time[0].value == pytest.approx(2 * two.time[0].value)  # matmul: half the machine


@pytest.mark.timeout(10)
def test_memory_bound_work_runs_at_the_measured_copy_rate():
    lay = cost.Layout(pp=1, dp=8, tp=1, zero=1, micro_batch=1, microbatches=4,
                      schedule="-", recompute=False, sp=False)
    assert A100.memory_Bps == pytest.approx(A100.hbm_Bps * A100.hbm_efficiency)
    assert 0 < A100.hbm_efficiency < 1 and "hbm_efficiency" in A100.sources
    terms = {t.name: t.value for t in cost.estimate(GPT_1B, lay, A100, 8).time}
    c = cost.layer_cost(GPT_1B, 1, 1, False)
    # fwd + 2 bwd passes of the elementwise bytes, 4 micro-batches, 24 layers
    assert terms["elementwise"] == pytest.approx(4 * 24 * 3 * c.elementwise_bytes / A100.memory_Bps)
    datasheet = dataclasses.replace(A100, hbm_efficiency=1.0)
    faster = {t.name: t.value for t in cost.estimate(GPT_1B, lay, datasheet, 8).time}
    assert faster["elementwise"] == pytest.approx(terms["elementwise"] * A100.hbm_efficiency)


@pytest.mark.timeout(20)
def test_fits_keeps_the_cuda_context_and_the_allocators_fragmentation_free():
    usable = (A100.memory_bytes - A100.context_bytes) * (1 - A100.fragmentation)
    assert A100.usable_bytes == pytest.approx(usable) and usable < 80e9 < A100.memory_bytes
    for key in ("context", "fragmentation", "memory"):
        assert A100.sources[key]
    plan = plan_layouts(GPT_7B, A100, 8, 8, 64, top=200)
    assert plan.ranked and max(e.memory for e in plan.ranked) <= usable
    # with no reserve, layouts between the usable bytes and the whole capacity come back
    bare = dataclasses.replace(A100, context_bytes=0.0, fragmentation=0.0)
    more = plan_layouts(GPT_7B, bare, 8, 8, 64, top=200)
    assert any(usable < e.memory <= A100.memory_bytes for e in more.ranked)


@pytest.mark.timeout(10)
def test_collective_bound_names_the_part_of_the_model_that_dominates():
    # this machine's emulated 1 Gbit/s fit (cpu-here): 526 us per message, 184 us per
    # sender and step, one CPU pool of 3.06 Gbit/s for all nodes
    fit = device("cpu-here").links()
    kind, seconds, parts = collective_bound("all-reduce", 0.1e6, 2, 1, fit)
    assert kind == "latency" and seconds == pytest.approx(predict_collective("all-reduce", 0.1e6, 2, 1, fit))
    assert sum(parts.values()) == pytest.approx(seconds)
    assert collective_bound("all-reduce", 100e6, 2, 1, fit)[0] == "bandwidth"
    slow_cpu = dataclasses.replace(fit, cpu_Bps=fit.link_Bps / 10)
    assert collective_bound("all-reduce", 100e6, 2, 1, slow_cpu)[0] == "cpu"
    tiny = parse_gpt("gpt:layers=2,hidden=64,heads=4,seq=64,vocab=128")
    lay = cost.Layout(pp=1, dp=2, tp=2, zero=0, micro_batch=4, microbatches=1,
                      schedule="-", recompute=False, sp=False)
    text = " ".join(t.formula for t in cost.estimate(tiny, lay, device("cpu-here"), 2).time)
    assert "latency-bound" in text  # --explain says it for the tp and the dp collectives
