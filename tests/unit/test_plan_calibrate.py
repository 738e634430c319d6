"""`disttrain plan layout --calibrate DIR` on a trace folder written here by code: the
measured forward/backward, optimizer and all-reduce times become the planner's inputs."""

import json

import pytest

from disttrain.cli import main
from disttrain.plan.calibrate import calibrate, calibrated_device
from disttrain.plan.cost import Layout, estimate
from disttrain.plan.devices import device
from disttrain.plan.gpt import parse_gpt

MODEL = "gpt:layers=2,hidden=64,heads=4,seq=64,vocab=128"
ALPHA, BPS = 300e-6, 50e6  # the all-reduce the fixture's spans follow (ring of 2 ranks)


def _ring_us(nbytes, n=2):
    return 1e6 * 2 * (n - 1) * (ALPHA + nbytes / n / BPS)


def write_trace(path, steps=4, fwd_ms=9.0, bwd_ms=20.0, opt_ms=2.0, tokens=1024):
    """A merged trace of a 2-rank DataParallel run: per step 2 micro-batches (F/B spans),
    an optimizer step, a 0.48 MB bucket all-reduce and a 4-byte loss all-reduce."""
    events, metrics = [], []
    for r in range(2):
        t = 0.0
        for s in range(steps):
            step_us = 2 * (fwd_ms + bwd_ms) * 1e3 + opt_ms * 1e3 + _ring_us(482308) + _ring_us(4)
            events.append({"ph": "X", "cat": "step", "name": f"step {s}", "pid": r, "tid": 0,
                           "ts": t, "dur": step_us})
            u = t
            for k in range(2):
                for name, ms in ((f"F{k}", fwd_ms), (f"B{k}", bwd_ms)):
                    events.append({"ph": "X", "cat": "pipeline", "name": name, "pid": r, "tid": 0,
                                   "ts": u, "dur": ms * 1e3, "args": {"stage": 0}})
                    u += ms * 1e3
            for nbytes in (482308, 4):
                events.append({"ph": "X", "cat": "comm", "name": "all_reduce", "pid": r, "tid": 100,
                               "ts": u, "dur": _ring_us(nbytes),
                               "args": {"bytes": nbytes, "ranks": 2, "group": "group [0-1]"}})
                u += _ring_us(nbytes)
            events.append({"ph": "X", "cat": "compute", "name": "optimizer.step", "pid": r, "tid": 0,
                           "ts": u, "dur": opt_ms * 1e3})
            metrics.append({"step": s, "rank": r, "step_time": step_us / 1e6, "tokens": tokens})
            t += step_us + 10.0
    procs = [{"pid": r, "rank": r, "role": "worker", "cost": {"cpus": 2, "local_ranks": 2}}
             for r in range(2)]
    (path / "trace.json").write_text(json.dumps({"traceEvents": events, "otherData": {"processes": procs}}))
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return path


def test_the_trace_s_compute_and_fitted_all_reduce_are_taken(tmp_path):
    c = calibrate(str(write_trace(tmp_path)), parse_gpt(MODEL))
    assert (c.world, c.micro_batch, c.microbatches) == (2, 8, 2)
    assert c.fwd_s == pytest.approx(9e-3) and c.bwd_s == pytest.approx(20e-3)
    assert c.optimizer_s == pytest.approx(2e-3)
    assert c.alpha == pytest.approx(ALPHA, rel=1e-6) and c.Bps == pytest.approx(BPS, rel=1e-6)
    assert "2 sizes" in c.comm_how and not c.remote


def test_calibrated_plan_predicts_the_fixture_s_step_and_differs_from_the_table(tmp_path):
    m = parse_gpt(MODEL)
    c = calibrate(str(write_trace(tmp_path)), m)
    lay = Layout(pp=1, dp=2, tp=1, zero=0, micro_batch=8, microbatches=2, schedule="-",
                 recompute=False, sp=False)
    plain = estimate(m, lay, device("cpu-here"), 8).step
    got = estimate(m, lay, calibrated_device(device("cpu-here"), m, c), 8).step
    # the planner prices one bf16 bucket (2 B/param: half the fixture's fp32 bytes) and the
    # 4-byte loss all-reduce (plan/per_step.py) with the fitted alpha and rate; the compute
    # and optimizer are the fixture's
    bucket = 2 * (ALPHA + 2 * m.params / 2 / BPS)
    loss = 2 * (ALPHA + 2 / BPS)
    acc = 2 * m.layers * 6 * m.layer_params / (device("cpu-here").memory_Bps / 2)
    assert got == pytest.approx(2 * (9e-3 + 20e-3) + 2e-3 + bucket + loss + acc, rel=1e-6)
    assert abs(got / c.step_s - 1) < 0.1 and abs(plain / got - 1) > 0.3, (plain, got, c.step_s)


def test_cli_explains_which_inputs_came_from_the_trace_and_refuses_what_it_cannot_use(tmp_path, capsys):
    d = write_trace(tmp_path)
    cmd = ["plan", "layout", "--model", MODEL, "--devices", "2", "--global-batch", "32",
           "--micro-batch", "8", "--pp", "1", "--tp", "1", "--explain"]
    assert main(cmd + ["--device", "cpu-here", "--calibrate", str(d)]) == 0
    out = capsys.readouterr().out
    for said in ("layer compute (traced)", "optimizer step (traced)", f"calibrated from the trace {d}",
                 "all-reduce inside a node: alpha 300 us, 0.4 Gbit/s", "measured step time (median)"):
        assert said in out, said
    assert main(cmd + ["--device", "a100-80gb", "--calibrate", str(d)]) == 2
    assert "--device cpu-here" in capsys.readouterr().err
    lines = (d / "metrics.jsonl").read_text().splitlines()
    (d / "metrics.jsonl").write_text("".join(
        json.dumps({k: v for k, v in json.loads(x).items() if k != "tokens"}) + "\n" for x in lines))
    assert main(cmd + ["--device", "cpu-here", "--calibrate", str(d)]) == 2
    assert "disttrain.log(tokens=" in capsys.readouterr().err
