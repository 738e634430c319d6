"""Tracing in one process: the format checker, hooks on and off, the step window, cut files."""

import importlib.util
import json
import shutil
import sys

import pytest
import torch
from torch import nn
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim_module

import disttrain
from disttrain import trace
from disttrain.trace import analysis, commstats, hooks
from disttrain.trace.metrics import StepMetrics
from disttrain.trace.recorder import parse_steps

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
    assert parse_steps("3:7") == (3, 7) and parse_steps("5:") == (5, None)
    assert parse_steps(None) == (0, None) and parse_steps(":4") == (0, 4)
    for bad in ("7:3", "x:y", "4", "-1:2"):
        with pytest.raises(ValueError, match="--trace-steps 10:20"):
            parse_steps(bad)


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


def _x(name, cat, pid, ts, dur, tid=0, **args):
    return {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": ts, "dur": dur,
            **({"args": args} if args else {})}


def test_collectives_bus_bandwidth_against_the_link_only_for_groups_across_nodes():
    procs = [{"rank": r, "pid": r, "node": r // 2, "link_gbps": 10.0} for r in range(4)]
    meta = {"processes": procs, "link_gbps": 10.0}
    events = [_x("all_reduce", "comm", r, 0, 1000, 100, group="world", ranks=4, bytes=10**6) for r in range(4)]
    events += [_x("all_gather", "comm", r, 0, 500, 100, group="group [0-1]", ranks=2, bytes=10**5) for r in (0, 1)]
    rows = {r["op"]: r for r in commstats.collectives(events, meta)}
    ar, ag = rows["all_reduce"], rows["all_gather"]
    # 1 MB in 1 ms is 8 Gbit/s of tensor; a ring all-reduce moves 2(n-1)/n = 1.5 of it per rank
    assert ar["bus_gbps"] == pytest.approx(12.0) and ar["link_share"] == pytest.approx(1.2)
    assert ar["crosses_nodes"] is True and ar["calls"] == 4 and ar["mb_per_s"] == pytest.approx(1000)
    assert ag["crosses_nodes"] is False and ag["link_share"] is None  # ranks 0-1 share node 0
    assert ag["bus_gbps"] == pytest.approx(8e-3 * 10**5 / 500)  # all-gather: (n-1) x the input
    unknown = commstats.collectives(events, {"link_gbps": 10.0})  # no node known: compared
    assert all(r["crosses_nodes"] is None and r["link_share"] for r in unknown)
    assert all(r["link_share"] is None for r in commstats.collectives(events))  # no cluster
    assert commstats.bus_factor("barrier", 4) == 0 and commstats.bus_factor("send", 2) == 1


def _bucket_trace(ready_late_at: float):
    """One backward [0, 1000] µs; a 1 MB bucket ready at 100 µs, a 3 MB one at `ready_late_at`;
    each reduced at 500 MB/s (500 bytes per µs)."""
    ev = [_x("backward", "compute", 0, 0, 1000)]
    for b, (ready, nbytes) in enumerate([(100, 10**6), (ready_late_at, 3 * 10**6)]):
        ev.append(_x(f"bucket {b}", "dp", 0, ready, nbytes / 500 + 50, 100, bucket=b, bytes=nbytes))
        ev.append(_x("all_reduce", "comm", 0, ready + 10, nbytes / 500, 101, bytes=nbytes, group="world", ranks=2))
    return ev


def test_bucket_advice_is_computed_from_the_trace_when_buckets_fire_late():
    late = commstats.bucket_timing(_bucket_trace(995))
    assert late == {"bytes": 4 * 10**6, "ready_at": pytest.approx((0.1 + 3 * 0.995) / 4),
                    "backward_us": 1000, "largest": 3 * 10**6, "rate": 500.0}
    advice = commstats.bucket_advice(_bucket_trace(995))
    # 0.1 x 1000 µs x 500 B/µs = 50 kB, below 1/16 of the 4 MB of gradients: 250 kB = 0.24 MiB
    assert advice.startswith("buckets fire late: the 4.00 MB of gradients per step are ready "
                             "for reduction on average 77% of the way") and "bucket_mb=0.24 " in advice
    assert "500 MB/s the bucket reductions achieved is 0.048 MiB; at least 1/16" in advice
    assert commstats.bucket_advice(_bucket_trace(500)) is None  # on average 40% through: in time
    run = {"metrics": [{"rank": 0, "step": s, "step_time": 0.01, "compute": 0.004, "exposed_comm": 0.006,
                        "data": 0.0, "idle": 0.0, "bytes": {"all_reduce": 4e6}} for s in range(3)],
           "events": _bucket_trace(995)}
    assert analysis.diagnose(run)[0] == f"exposed communication is 60% of the median step (per step and rank: all_reduce 4.00 MB): {advice}"


def test_step_metrics_tokens_add_up_and_ps_versions_give_staleness(tmp_path):
    m = StepMetrics(str(tmp_path), 0, 0, 1)
    m.log({"tokens": 100.0, "loss": 2.0})
    m.log({"tokens": 28.0, "loss": 1.5})  # two micro-steps in one step: tokens add up
    m.ps_pushed([3, 3])  # the first push: no previous version to compare with
    m.close_step(0, 0.0, 2e6, record=True)
    m.ps_pushed([6, 7])  # the servers moved 3.5 versions: this worker's push and 2.5 others'
    m.close_step(1, 2e6, 3e6, record=True)
    m.ps_pushed([-1, 7])  # before a pull (welcome): nothing known
    m.close_step(2, 3e6, 4e6, record=True)
    m.close_step(3, 4e6, 5e6, record=False)  # outside the window: no line
    m.close()
    first, second, third = [json.loads(x) for x in open(m.path).read().splitlines()]
    assert first["tokens"] == 128 and first["tokens_per_s"] == 64 and first["loss"] == 1.5
    assert first["ps_version"] == 3 and "ps_staleness" not in first
    assert second["ps_updates"] == 3.5 and second["ps_staleness"] == 2.5 and second["ps_updates_per_s"] == 3.5
    assert "tokens" not in second and "ps_version" not in third


def test_tensorboard_has_the_metrics_scalars_per_rank_and_nothing_without_it(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    trace.start(str(tmp_path))
    _train(3, model, torch.optim.SGD(model.parameters(), lr=0.1),
           trace.data([(torch.randn(2, 3), torch.randn(2, 1))] * 3))
    trace.stop()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    if importlib.util.find_spec("tensorboard") is None:  # the optional extra is not installed
        assert not (tmp_path / "tensorboard").exists()
        pytest.skip("tensorboard is not installed: pip install 'disttrain[tensorboard]' (dev has it)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard" / "rank0"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"step_time", "compute", "exposed_comm", "idle", "samples_per_s", "loss",
            "peak_memory_bytes"} <= tags, tags
    for tag in ("step_time", "loss", "samples_per_s"):
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert got == [(m["step"], pytest.approx(m[tag], rel=1e-6)) for m in lines], tag
    shutil.rmtree(tmp_path / "tensorboard")
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if not installed
    assert trace.merge(str(tmp_path))["tensorboard"] is None
    assert not (tmp_path / "tensorboard").exists() and (tmp_path / "metrics.jsonl").exists()


def test_rows_of_every_kind_expand_to_valid_events_and_bad_rows_are_counted(tmp_path):
    from disttrain.comm.flight import Entry
    from disttrain.trace.merge import read_rank_file
    from disttrain.trace.recorder import Recorder
    from disttrain.trace.rows import COMM_TID, ROWS

    rec = Recorder(str(tmp_path), 0, 1)
    entry = Entry(7, "isend", "p2p 0->1", (0, 1), [[4, 8]], "float32", "train.py:3", "f", 0.0)
    rec.complete("forward", "compute", 1.0, 9.0, {"module": "Net"}, 0)
    rec.collective(2.0, 5.0, entry, 128, exposed=True)
    rec.waited("wait irecv", 5.0, 6.0, "irecv", "p2p 1->0", 3)
    rec.pipeline([("P", 6.0, 2.0, "F0", 0, 0, 1)])
    rec.instant("mark", "user", {"k": 1})
    rec.counter("logged", 8.0, {"loss": 0.5})
    rec.comm_span("push", 3.0, 7.0, {"op": "push"}, [("s", "push s0 w0 c1")])  # overlaps the isend
    rec.bucket(0, 10.0, 11.0, 14.0, 512)
    rec.close()
    with open(rec.path, "a") as fp:
        fp.write('[["X", 1.0], ["?"], 3, [[1]], ["K", 1, 2, "a", "g", 2, 1, 8, "s", null, 9],'
                 ' ["K", 1, 2, 99, 1, 2, 1, 8, 1, null]]\n')
    with open(rec.path) as fp:
        rows = [r for line in fp.readlines()[1:] for r in json.loads(line) if isinstance(r, list)]
    (k_row,) = [r for r in rows if r[0] == "K" and r[3] != 99 and len(r) == 10]
    assert all(isinstance(k_row[i], int) for i in (3, 4, 8))  # op, group, site: numbered strings
    header, events, skipped = read_rank_file(rec.path)
    # too short, unknown, not a row (2), too long, a string number no "S" row defined
    assert header["rank"] == 0 and skipped == 6
    by_name = {e["name"]: e for e in events if e["ph"] == "X" and e["cat"] != "comm.exposed"}
    by_name["wait irecv"] = next(e for e in events if e["name"] == "wait irecv")
    assert by_name["isend"]["cat"] == "comm" and by_name["isend"]["args"] == {
        "op": "isend", "group": "p2p 0->1", "ranks": 2, "seq": 7, "bytes": 128, "site": "train.py:3"}
    assert by_name["wait irecv"]["cat"] == "comm.exposed" and by_name["wait irecv"]["args"]["seq"] == 3
    assert by_name["F0"]["cat"] == "pipeline" and by_name["F0"]["args"] == {"microbatch": 0, "chunk": 0, "stage": 1}
    exposed = [e for e in events if e.get("cat") == "comm.exposed" and e["name"] == "isend"]
    assert len(exposed) == 1 and exposed[0]["tid"] == 0 and exposed[0]["dur"] == 3.0
    # lanes are the merge's: the push overlaps the isend (another lane), the bucket does not
    isend, push, bucket, reduce = (by_name[n] for n in ("isend", "push", "bucket 0", "reduce"))
    assert isend["tid"] == bucket["tid"] == reduce["tid"] == COMM_TID and push["tid"] == COMM_TID + 1
    assert reduce["ts"] == 11.0 and reduce["dur"] == 3.0 and bucket["args"] == {"bucket": 0, "bytes": 512}
    flows = {e["id"]: e for e in events if e["ph"] in ("s", "f")}
    assert flows[(0 * 4096 + 1) * 2**28 + 7]["tid"] == COMM_TID and flows["push s0 w0 c1"]["tid"] == COMM_TID + 1
    lanes = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"comm", "comm 2"} <= lanes
    assert {e["ph"] for e in events} >= {"X", "i", "C", "s", "M"} and len(ROWS) == 11
    done = trace.merge(str(tmp_path))
    with open(done["path"]) as fp:
        tr = json.load(fp)
    kept = [e for e in tr["traceEvents"] if e["ph"] != "s"]  # its receive is not in this trace
    assert trace.problems({**tr, "traceEvents": kept}) == []


@pytest.mark.parametrize("where", ["", "missing", "empty"])
def test_merge_refuses_a_folder_without_trace_files(tmp_path, where, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="trace"):
        trace.merge(where)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"] and not any((tmp_path / "empty").iterdir())


def test_overlap_of_pipeline_actions_and_exposed_waits_matches_every_pair():
    import random

    def disjoint(n):
        points = sorted(rng.uniform(0, 100) for _ in range(2 * n))
        return [(points[2 * i], points[2 * i + 1]) for i in range(n)]

    rng = random.Random(0)
    for _ in range(500):
        xs, ys = disjoint(rng.randint(0, 8)), disjoint(rng.randint(0, 12))
        every_pair = sum(max(0.0, min(b, d) - max(a, c)) for a, b in xs for c, d in ys)
        assert hooks._overlap(xs, ys) == pytest.approx(every_pair, abs=1e-9)


def test_a_subset_of_ranks_can_trace_without_aligning_or_merging(tmp_path):
    trace.start(str(tmp_path), align=False)  # e.g. a parameter server's workers, not its servers
    assert hooks.active.rec.clock == {"offset_us": 0.0, "error_us": 0.0, "rounds": 0}
    _train(2, nn.Linear(3, 1), torch.optim.SGD(nn.Linear(3, 1).parameters(), lr=0.1),
           trace.data([(torch.randn(2, 3), torch.randn(2, 1))] * 2))
    assert trace.stop(merge_files=False) is None and not (tmp_path / "trace.json").exists()
    done = trace.merge(str(tmp_path))
    assert done["processes"] == 1 and trace.problems(done["path"]) == []


def test_a_failing_writer_stops_tracing_and_keeps_emptying_the_buffer(tmp_path, capsys):
    import time

    from disttrain.trace.recorder import Recorder

    rec = Recorder(str(tmp_path), 0, 1, flush_s=0.05)
    rec.metrics.flush = lambda: 1 / 0  # a bug in building a step's line, say
    rec.push(("i", 1.0, 0, "mark", "user", None))
    deadline = time.time() + 10
    while not rec._closed and time.time() < deadline:
        time.sleep(0.02)
    assert rec._closed and "ZeroDivisionError" in capsys.readouterr().out
    for _ in range(1000):  # the training thread goes on appending; the writer drops it
        rec.push(("i", 2.0, 0, "mark", "user", None))
    while rec._buf and time.time() < deadline:
        time.sleep(0.02)
    assert not rec._buf
    rec.close()
