"""Tracing in one process: the format checker, hooks on and off, the step window, cut files."""

import json

import pytest
import torch
from torch import nn
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim_module

import disttrain
from disttrain import trace
from disttrain.trace import hooks

GOOD = {"traceEvents": [
    {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "rank 0"}},
    {"ph": "X", "name": "step 0", "cat": "step", "ts": 0, "dur": 100, "pid": 0, "tid": 0},
    {"ph": "X", "name": "forward", "cat": "compute", "ts": 10, "dur": 20, "pid": 0, "tid": 0},
    {"ph": "X", "name": "send", "cat": "comm", "ts": 40, "dur": 10, "pid": 0, "tid": 100},
    {"ph": "s", "name": "p2p", "cat": "flow", "id": 7, "ts": 40, "pid": 0, "tid": 100, "bp": "e"},
    {"ph": "X", "name": "recv", "cat": "comm", "ts": 30, "dur": 30, "pid": 1, "tid": 100},
    {"ph": "f", "name": "p2p", "cat": "flow", "id": 7, "ts": 59, "pid": 1, "tid": 100, "bp": "e"},
    {"ph": "C", "name": "logged", "ts": 50, "pid": 0, "tid": 0, "args": {"loss": 1.5}},
]}


def _with(**changes):
    t = json.loads(json.dumps(GOOD))
    for index, fields in changes.items():
        t["traceEvents"][int(index[1:])].update(fields)
    return t


def test_checker_accepts_a_good_trace_and_names_each_defect():
    assert trace.problems(GOOD) == []
    assert trace.problems([]) == [] and trace.problems({}) != []
    bad = {
        "no ts": _with(e1={"ts": "0"}),
        "dur >= 0": _with(e2={"dur": -1}),
        "unknown phase": _with(e2={"ph": "Q"}),
        "half-overlaps": _with(e2={"ts": 90, "dur": 20}),
        "needs an id": _with(e4={"id": None}),
        "not inside a span": _with(e6={"ts": 70}),
        "only ['s']": _with(e6={"id": 8}),
        "counter values": _with(e7={"args": {"loss": "high"}}),
        "unknown metadata": _with(e0={"name": "process_colour"}),
    }
    for words, t in bad.items():
        found = trace.problems(t)
        assert any(words.replace("no ts", "ts must be") in p for p in found), (words, found)


def test_parse_steps():
    assert trace.parse_steps("3:7") == (3, 7) and trace.parse_steps("5:") == (5, None)
    assert trace.parse_steps(None) == (0, None) and trace.parse_steps(":4") == (0, 4)
    for bad in ("7:3", "x:y", "4", "-1:2"):
        with pytest.raises(ValueError, match="--trace-steps 10:20"):
            trace.parse_steps(bad)


def _hook_counts():
    return (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks),
            len(optim_module._global_optimizer_pre_hooks), len(optim_module._global_optimizer_post_hooks))


def _train(steps: int, model, opt, loader):
    for i, (x, y) in enumerate(loader):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        disttrain.log(loss=loss)
        if i + 1 == steps:
            break


def test_one_process_window_hooks_installed_only_while_on(tmp_path):
    before = _hook_counts()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(5, 4), torch.randn(5, 1)) for _ in range(6)]
    trace.start(str(tmp_path), steps="2:4")
    assert hooks.active is not None and _hook_counts() == tuple(n + 1 for n in before)
    loader = trace.data(batches)
    _train(2, model, opt, loader)
    # once the first step has ended the module hooks are the model's own, not torch's global
    # ones (which send every submodule call through torch's slow path)
    assert _hook_counts() == (*before[:2], before[2] + 1, before[3] + 1)
    assert len(model._forward_pre_hooks) == len(model._forward_hooks) == 1
    _train(4, model, opt, loader)
    path = trace.stop()  # no launcher: this (rank 0) process merges
    assert hooks.active is None and _hook_counts() == before
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert trace.data(batches) is batches  # off: the iterable itself
    with open(path) as fp:
        tr = json.load(fp)
    assert trace.problems(tr) == []
    spans = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    assert sorted({e["name"] for e in spans if e["name"].startswith("step")}) == ["step 2", "step 3"]
    assert [e["name"] for e in spans].count("forward") == 2
    (step2,) = [e for e in spans if e["name"] == "step 2"]
    inner = [e for e in spans if e["name"] in ("data", "forward", "backward", "optimizer.step")
             and step2["ts"] <= e["ts"] < step2["ts"] + step2["dur"] - 0.01]
    assert [e["name"] for e in sorted(inner, key=lambda e: e["ts"])] == [
        "data", "forward", "backward", "optimizer.step"]
    with open(tmp_path / "metrics.jsonl") as fp:
        lines = [json.loads(line) for line in fp]
    assert [m["step"] for m in lines] == [2, 3] and all(m["samples"] == 5 and m["loss"] > 0 for m in lines)


def test_cut_rank_file_still_merges_to_valid_json(tmp_path):
    trace.start(str(tmp_path))
    _train(2, nn.Linear(3, 1), torch.optim.SGD(nn.Linear(3, 1).parameters(), lr=0.1),
           trace.data([(torch.randn(2, 3), torch.randn(2, 1))] * 2))
    trace.stop()
    (rank_file,) = tmp_path.glob("rank0.*.jsonl")
    with open(rank_file, "a") as fp:
        fp.write('{"ph":"X","name":"forw')  # what a rank killed mid-write leaves
    done = trace.merge(str(tmp_path))
    assert done["skipped_lines"] == 1 and done["processes"] == 1
    assert trace.problems(done["path"]) == []


def test_merge_drops_flow_ends_whose_partner_is_missing(tmp_path):
    trace.start(str(tmp_path))
    _train(1, nn.Linear(3, 1), torch.optim.SGD(nn.Linear(3, 1).parameters(), lr=0.1),
           trace.data([(torch.randn(2, 3), torch.randn(2, 1))]))
    rec = hooks.active.rec
    with trace.events.span("send-like"):
        rec.flow("s", "kept", hooks.now_us())
        rec.flow("s", "cut", hooks.now_us())  # its receive fell outside the window
    with trace.events.span("recv-like"):
        rec.flow("f", "kept", hooks.now_us())
    path = trace.stop()
    with open(path) as fp:
        tr = json.load(fp)
    assert sorted(e["id"] for e in tr["traceEvents"] if e["ph"] in ("s", "f")) == ["kept", "kept"]
    assert trace.problems(tr) == []
