"""`disttrain plan profile`: per-layer times of a real module, and `plan layout --profile`."""

from __future__ import annotations

import dataclasses
import json
import textwrap

import pytest

from disttrain import cli
from disttrain.plan.cost import ENDS, UNITS, blocking_extra
from disttrain.plan.devices import device
from disttrain.plan.gpt import parse_gpt
from disttrain.plan.layout import Pins, plan_layouts
from disttrain.plan.profile import backward_seconds
from disttrain.plan.profiled import FORMAT, load_profile, median_profile

TINY = "gpt:layers=2,hidden=64,heads=4,seq=64,vocab=128"
SCRIPT = textwrap.dedent("""
    import torch
    from disttrain.models.gpt import GPT, GPTConfig

    def profile_target():
        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=128, block_size=64, n_layer=2, n_head=4, n_embd=64)
        return GPT(cfg), torch.randint(0, 128, (4, 64))

    if __name__ == "__main__":
        raise SystemExit("the profiler must not run the script's main block")
""")


def _synthetic(tmp_path, block_fwd: float, block_bwd: float, name="p.json"):
    """A profile file of the tiny GPT with chosen block and head seconds (batch 4)."""
    rows = [{"name": "embed", "kind": "Embed", "forward_s": 1e-4, "backward_s": 1e-4},
            *({"name": f"blocks.{i}", "kind": "Block", "forward_s": block_fwd,
               "backward_s": block_bwd} for i in range(2)),
            {"name": "head", "kind": "Head", "forward_s": 0.002, "backward_s": 0.004}]
    path = tmp_path / name
    path.write_text(json.dumps({"format": FORMAT, "device": "cpu", "threads": 1, "cpus": 1, "steps": 3,
                                "batch": 4, "seq": 64, "gpt": TINY, "layers": rows}))
    return str(path)


@pytest.mark.timeout(60)
def test_profile_times_each_top_level_layer_of_the_gpt(tmp_path, capsys):
    script, out = tmp_path / "tiny.py", tmp_path / "tiny.json"
    script.write_text(SCRIPT)
    argv = ["plan", "profile", str(script), "--out", str(out), "--steps", "3", "--threads", "1"]
    assert cli.main(argv) == 0
    prof = json.loads(out.read_text())
    rows = {r["name"]: r for r in prof["layers"]}
    assert list(rows) == ["embed", "blocks.0", "blocks.1", "head"]  # GPT.pipeline_layers()
    assert [rows[n]["kind"] for n in rows] == ["Embed", "Block", "Block", "Head"]
    assert all(r["forward_s"] > 0 and r["backward_s"] > 0 for r in rows.values())
    assert prof["gpt"] == TINY and (prof["batch"], prof["seq"], prof["threads"]) == (4, 64, 1)
    # identical blocks save identical activations: the fp32 (B, T, C) tensors autograd keeps
    saved = rows["blocks.0"]["activation_bytes"]
    assert saved == rows["blocks.1"]["activation_bytes"] and saved >= 10 * 4 * 64 * 64 * 4
    assert rows["blocks.0"]["params"] == 12 * 64 * 64 + 13 * 64
    assert "blocks.1" in capsys.readouterr().out
    assert prof["backward_order"] == ["head", "blocks.1", "blocks.0", "embed"]  # every hook fired
    opt = prof["optimizer"]  # an AdamW step over every parameter, timed after the layers
    assert opt["name"] == "AdamW" and opt["step_s"] >= opt["step_min_s"] > 0
    assert opt["params"] == sum(r["params"] for r in rows.values())
    # the planner prices the optimizer with it: that step x this shard's params / profiled
    gpt = parse_gpt(TINY)
    dev = dataclasses.replace(device("cpu-here"), profile=load_profile(str(out), gpt))
    for zero, dp in ((0, 1), (1, 2)):
        est = plan_layouts(gpt, dev, dp, 8, 8, Pins(micro_batch=4, tp=1, pp=1, zero=zero), top=1).ranked[0]
        term = {t.name: t.value for t in est.time}["optimizer step (profiled)"]
        shard = (2 * gpt.layer_params + gpt.embed_params) / dp
        assert term == pytest.approx(opt["step_s"] * shard / opt["params"] * max(1, dp / prof["cpus"]))


def test_backward_seconds_split_the_backward_between_consecutive_layers():
    starts = {"blocks.0": 3.0, "head": 1.0, "embed": 4.5, "blocks.1": 1.5}
    got = backward_seconds(starts, 5.0)
    assert list(got) == ["head", "blocks.1", "blocks.0", "embed"]
    assert got == pytest.approx({"head": 0.5, "blocks.1": 1.5, "blocks.0": 1.5, "embed": 0.5})
    assert sum(got.values()) == pytest.approx(5.0 - 1.0)  # the whole backward after the head's start


@pytest.mark.timeout(30)
def test_profile_replaces_flop_derived_compute(tmp_path):
    gpt = parse_gpt(TINY)
    here = device("cpu-here")
    slow, fast = (dataclasses.replace(here, profile=load_profile(_synthetic(tmp_path, f, 2 * f, n), gpt))
                  for f, n in ((0.010, "slow.json"), (0.005, "fast.json")))
    pins = Pins(micro_batch=2)
    plans = {k: plan_layouts(gpt, d, 1, 8, 8, pins, top=1).ranked[0]
             for k, d in (("slow", slow), ("fast", fast), ("flops", here))}
    lay = plans["slow"].layout
    assert (lay.pp, lay.dp, lay.tp, lay.microbatches) == (1, 1, 1, 4)
    terms = {k: {t.name: t.value for t in e.time} for k, e in plans.items()}
    # 4 micro-batches x 2 layers x (10 + 20 ms) x b 2 / profiled b 4
    assert terms["slow"]["layer compute (profiled)"] == pytest.approx(4 * 2 * 0.030 * 2 / 4)
    assert terms["fast"]["layer compute (profiled)"] == pytest.approx(
        terms["slow"]["layer compute (profiled)"] / 2)
    assert terms["slow"]["LM head (last stage)"] == pytest.approx(4 * 0.006 * 2 / 4)
    gap = terms["slow"]["layer compute (profiled)"] / 2
    assert plans["slow"].step - plans["fast"].step == pytest.approx(gap, rel=1e-6)
    assert "matmul" in terms["flops"] and "layer compute (profiled)" not in terms["flops"]
    # two ranks share the profiled machine (1 thread on 1 CPU): each runs twice as slowly
    two = plan_layouts(gpt, slow, 2, 8, 8, Pins(micro_batch=2, tp=1, pp=1, zero=0), top=1).ranked[0]
    assert {t.name: t.value for t in two.time}["layer compute (profiled)"] == pytest.approx(
        2 * 2 * 0.030 * 2 / 4 * 2)


@pytest.mark.timeout(30)
def test_profile_errors_say_what_to_fix(tmp_path, capsys):
    bare = tmp_path / "bare.py"
    bare.write_text("x = 1\n")
    assert cli.main(["plan", "profile", str(bare), "--out", str(tmp_path / "o.json")]) == 2
    assert "defines no profile_target()" in capsys.readouterr().err
    prof = _synthetic(tmp_path, 0.01, 0.02)
    base = ["plan", "layout", "--profile", prof, "--devices", "2", "--global-batch", "8"]
    assert cli.main([*base, "--device", "a100-80gb"]) == 2
    assert "plan it with --device cpu-here" in capsys.readouterr().err
    wrong = "gpt:layers=4,hidden=64,heads=4,seq=64,vocab=128"
    assert cli.main([*base, "--device", "cpu-here", "--model", wrong]) == 2
    assert "measured 2 Block layers; --model has layers=4" in capsys.readouterr().err
    assert cli.main([*base, "--device", "cpu-here", "--explain"]) == 0  # model: the profile's
    out = capsys.readouterr().out
    assert "GPT on 2 x cpu-here" in out and "layer compute (profiled)" in out


def _with_ranks(path: str, shared: dict, collectives: dict) -> str:
    data = json.loads(open(path).read())
    data.update(shared=shared, collectives=collectives)
    with open(path, "w") as f:
        json.dump(data, f)
    return path


def _terms(gpt, dev, n, pins):
    est = plan_layouts(gpt, dev, n, 8, 8, pins, top=1).ranked[0]
    return est, {t.name: t.value for t in est.time}


@pytest.mark.timeout(30)
def test_measured_sharing_and_blocking_collectives_replace_the_formula(tmp_path):
    gpt = parse_gpt(TINY)
    here = device("cpu-here")
    plain = dataclasses.replace(here, profile=load_profile(_synthetic(tmp_path, 0.01, 0.02), gpt))
    path = _with_ranks(_synthetic(tmp_path, 0.01, 0.02, "m.json"), {"2": 1.5},
                       {"2": {"bytes": 262144, "inline_s": 0.004}})
    measured = dataclasses.replace(here, profile=load_profile(path, gpt))
    dp2 = Pins(micro_batch=2, tp=1, pp=1, zero=0)
    # 1 thread on 1 CPU: processor sharing says 2 ranks run 2x slower; the file measured 1.5x
    _, a = _terms(gpt, plain, 2, dp2)
    _, b = _terms(gpt, measured, 2, dp2)
    assert b["layer compute (profiled)"] == pytest.approx(a["layer compute (profiled)"] * 1.5 / 2)
    assert "measured" in next(t.formula for t in plan_layouts(gpt, measured, 2, 8, 8, dp2, top=1)
                              .ranked[0].time if t.name == "layer compute (profiled)")
    # a count it did not measure (4 ranks) keeps the formula
    dp4 = Pins(micro_batch=2, tp=1, pp=1, zero=0)
    assert _terms(gpt, plain, 4, dp4)[1]["layer compute (profiled)"] == pytest.approx(
        _terms(gpt, measured, 4, dp4)[1]["layer compute (profiled)"])
    # tp = 2: every blocking all-reduce costs the measured 4 ms minus the model's price of
    # the measured one more than the link model alone says
    tp2 = Pins(micro_batch=2, tp=2, pp=1, zero=0)
    _, a = _terms(gpt, plain, 2, tp2)
    est, b = _terms(gpt, measured, 2, tp2)
    extra = blocking_extra(measured.per_rank(2))
    assert 0 < extra < 0.004
    calls = est.layout.microbatches * 2 * 4  # micro-batches x 2 layers x 4 all-reduces each
    assert b["tp all-reduce"] - a["tp all-reduce"] == pytest.approx(calls * extra)
    # ZeRO-3 with the cores full: each layer's UNITS gathers block, none hidden by prefetch,
    # and so do their reduce-scatters in the backward
    z3 = Pins(micro_batch=2, tp=1, pp=1, zero=3)
    _, a = _terms(gpt, plain, 2, z3)
    est, b = _terms(gpt, measured, 2, z3)
    mb = est.layout.microbatches  # x (2 layers x UNITS + the ENDS) x (fwd gather + bwd
    assert b["ZeRO-3 gathers (exposed)"] - a["ZeRO-3 gathers (exposed)"] == pytest.approx(
        mb * (2 * 3 * UNITS + 3 * ENDS) * extra)  # gather + bwd reduce-scatter)
    assert a["ZeRO-3 gathers (exposed)"] > 0  # 1 CPU: nothing hides a gather


def test_bad_measurements_in_a_profile_say_how_to_fix(tmp_path):
    gpt = parse_gpt(TINY)
    for shared, coll in (({"1": 2.0}, {}), ({"2": -1}, {}), ({}, {"2": {"bytes": 0, "inline_s": 1}}),
                         ({}, {"2": {"inline_s": 1}}), ({"2": "x"}, {}), ({"2": "nan"}, {}),
                         ({}, {"2": {"bytes": 8, "inline_s": "nan"}}),
                         ({}, {"2": {"bytes": "inf", "inline_s": 0.001}})):
        path = _with_ranks(_synthetic(tmp_path, 0.01, 0.02, "bad.json"), shared, coll)
        with pytest.raises(ValueError, match="plan profile --ranks"):
            load_profile(path, gpt)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_profile_ranks_measures_sharing_and_a_blocking_all_reduce_here(tmp_path, capsys):
    script, out = tmp_path / "tiny.py", tmp_path / "tiny.json"
    script.write_text(SCRIPT)
    argv = ["plan", "profile", str(script), "--out", str(out), "--steps", "3", "--threads", "1",
            "--ranks", "2"]
    assert cli.main(argv) == 0
    prof = json.loads(out.read_text())
    assert set(prof["shared"]) == {"2"} and prof["shared"]["2"] > 0
    c = prof["collectives"]["2"]
    assert c["bytes"] == 4 * 4 * 64 * 64 and c["inline_s"] >= 0 and c["alone_s"] > 0
    assert 0 < c["call_s"] <= c["both_s"] and c["compute_cpu_s"] > 0  # the alternating loop
    text = capsys.readouterr().out
    assert "2 copies at once" in text and "2 ranks in pairs" in text
    two = load_profile(str(out), parse_gpt(TINY)).shared(2)
    assert two.inline == (c["bytes"], c["inline_s"])
    assert two.alternate().inline == (c["bytes"], c["call_s"])
    assert cli.main([*argv[:-1], "1"]) == 2
    assert "--ranks '1': each count must be 2..64" in capsys.readouterr().err


def test_median_profile_takes_each_numbers_median_and_refuses_other_scripts(tmp_path):
    runs = [json.loads(open(_synthetic(tmp_path, f, 2 * f, f"r{i}.json")).read())
            for i, f in enumerate((0.010, 0.030, 0.011))]  # the second run hit a burst of load
    runs[0]["shared"], runs[1]["shared"], runs[2]["shared"] = {"2": 1.1}, {"2": 0.7}, {"2": 1.2}
    merged = median_profile(runs)
    blocks = [r for r in merged["layers"] if r["kind"] == "Block"]
    assert [b["forward_s"] for b in blocks] == [0.011, 0.011]
    assert [b["backward_s"] for b in blocks] == [0.022, 0.022]
    assert merged["shared"] == {"2": 1.1} and merged["gpt"] == TINY and merged["batch"] == 4
    gpt = parse_gpt(TINY)
    path = tmp_path / "merged.json"
    path.write_text(json.dumps(merged))
    assert load_profile(str(path), gpt).fwd_s == pytest.approx(0.011)  # the file stays valid
    other = dict(runs[2], gpt="gpt:layers=2,hidden=64,heads=4,seq=64,vocab=256")
    with pytest.raises(ValueError, match="profiles differ at profile.gpt"):
        median_profile([runs[0], other])
    with pytest.raises(ValueError, match="length of profile.layers"):
        median_profile([runs[0], dict(runs[1], layers=runs[1]["layers"][:2])])


@pytest.mark.timeout(60)
def test_profile_repeat_writes_the_median_of_its_runs(tmp_path, capsys):
    script, out = tmp_path / "tiny.py", tmp_path / "tiny.json"
    script.write_text(SCRIPT)
    argv = ["plan", "profile", str(script), "--out", str(out), "--steps", "2", "--threads", "1"]
    assert cli.main([*argv, "--repeat", "0"]) == 2
    assert "--repeat must be >= 1, got 0" in capsys.readouterr().err
    assert cli.main([*argv, "--repeat", "3"]) == 0
    assert "the median of 3 runs" in capsys.readouterr().out
    prof = json.loads(out.read_text())
    assert [r["name"] for r in prof["layers"]] == ["embed", "blocks.0", "blocks.1", "head"]
    assert all(r["forward_s"] >= r["forward_min_s"] > 0 for r in prof["layers"])


def test_copies_meet_before_measuring_and_a_failed_copy_stops_the_others(tmp_path):
    """--ranks' copies measure together (each waits at `_meet` for all n), and a copy that
    fails is reported at once with its own error, the others killed, not waited for."""
    import subprocess
    import sys
    import threading
    import time

    from disttrain.plan.profile import _meet
    from disttrain.plan.profile_shared import _wait_all

    met = []
    first = threading.Thread(target=lambda: met.append(_meet(str(tmp_path), "warm", 2)))
    first.start()
    time.sleep(0.3)
    assert first.is_alive() and not met  # NOTE: alone it waits for the second copy
    with open(tmp_path / "warm.999999", "w"):
        pass
    first.join(timeout=5)
    assert met == [None]
    with pytest.raises(ValueError, match="fewer than 3 copies reached 'measured'"):
        _meet(str(tmp_path), "measured", 3, timeout=0.2)

    errs = [str(tmp_path / "a.err"), str(tmp_path / "b.err")]
    code = ["import time; time.sleep(60)", "import sys; sys.exit('copy 1: boom')"]
    procs = []
    for c, e in zip(code, errs):
        with open(e, "w") as f:
            procs.append(subprocess.Popen([sys.executable, "-c", c], stderr=f))
    t = time.monotonic()
    assert _wait_all(procs, errs, timeout=30) == ["copy 1: boom"]
    assert time.monotonic() - t < 20 and procs[0].poll() is not None
