"""Tracing on real processes: format, nesting, aligned clocks, the time breakdown."""

import json
from collections import defaultdict

import pytest

from disttrain import testing, trace
from disttrain.trace import analysis, commstats
from tests.dist._trace_fns import traced_training

STEPS = 4
WORLD = 3


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Two traced jobs in one spawn: native DataParallel, then DataParallel with
    algorithm='ring' and one late 3 MB bucket, the ranks told of a 10 Gbit/s link."""
    directory, ring_dir = tmp_path_factory.mktemp("trace"), tmp_path_factory.mktemp("ring")
    results = testing.spawn(traced_training, WORLD, str(directory), STEPS, str(ring_dir),
                            timeout=240, env={"DISTTRAIN_LINK_GBPS": "10"})
    return directory, ring_dir, results


@pytest.fixture(scope="module")
def traced(jobs):
    directory, _, results = jobs
    with open(directory / "trace.json") as fp:
        events = json.load(fp)
    with open(directory / "metrics.jsonl") as fp:
        metrics = [json.loads(line) for line in fp]
    return results, events, metrics


def test_trace_is_valid_nested_and_has_every_rank(traced):
    results, tr, _ = traced
    assert results[0]["path"].endswith("trace.json") and results[1]["path"] is None
    assert trace.problems(tr) == []  # format, nesting on every track, flows paired
    names = {e["args"]["name"] for e in tr["traceEvents"] if e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1", "rank 2"}
    spans = defaultdict(int)
    for e in tr["traceEvents"]:
        if e["ph"] == "X":
            spans[(e["pid"], e["name"])] += 1
    for pid in range(WORLD):
        for name in ("data", "forward", "backward", "optimizer.step"):
            assert spans[(pid, name)] == STEPS, (pid, name, dict(spans))
        assert all(spans[(pid, f"step {s}")] == 1 for s in range(STEPS))
    for pid in range(WORLD):  # DataParallel's bucket: a span ready -> done, its reduce inside
        _check_buckets(tr["traceEvents"], pid, "all_reduce", STEPS)
    flows = [e for e in tr["traceEvents"] if e["ph"] in ("s", "f")]
    assert sorted((e["ph"], e["pid"]) for e in flows) == [("f", 1), ("s", 0)]


def _check_buckets(events, pid, op, steps):
    """Each bucket a span on a communication lane, `reduce` inside it on the same lane, the
    bucket's collective issued inside `reduce`; one bucket per step here."""
    dp = sorted((e for e in events if e["pid"] == pid and e.get("cat") == "dp"), key=lambda e: (e["ts"], -e["dur"]))
    assert [e["name"] for e in dp] == ["bucket 0", "reduce"] * steps, [e["name"] for e in dp]
    comm = [e for e in events if e["pid"] == pid and e["ph"] == "X" and e["name"] == op]
    for bucket, reduce in zip(dp[::2], dp[1::2]):
        assert bucket["tid"] == reduce["tid"] >= 100 and bucket["args"]["bytes"] > 0
        assert bucket["ts"] <= reduce["ts"]
        assert reduce["ts"] + reduce["dur"] == pytest.approx(bucket["ts"] + bucket["dur"], abs=0.002)
        assert any(reduce["ts"] <= c["ts"] <= reduce["ts"] + reduce["dur"] and c["args"]["bytes"] == bucket["args"]["bytes"]
                   for c in comm), (bucket, comm)


def test_same_all_reduce_overlaps_on_every_rank_in_aligned_time(traced):
    _, tr, _ = traced
    err = tr["otherData"]["max_clock_error_us"]
    by_call = defaultdict(dict)
    for e in tr["traceEvents"]:
        if e["ph"] == "X" and e["cat"] == "comm" and e["name"] == "all_reduce":
            by_call[(e["args"]["group"], e["args"]["seq"])][e["pid"]] = (e["ts"], e["ts"] + e["dur"])
    assert len(by_call) == 2 * STEPS  # DataParallel's bucket and the script's own, per step
    for call, spans in by_call.items():
        assert len(spans) == 3, call
        assert max(s for s, _ in spans.values()) <= min(e for _, e in spans.values()) + err, (call, spans)


def _breakdown_from_trace(events, pid, step):
    """compute / exposed_comm / data / idle of one step span, from the merged trace alone."""
    main = [e for e in events if e["ph"] == "X" and e["pid"] == pid and e["tid"] == 0]
    (span,) = [e for e in main if e["name"] == f"step {step}"]
    t0, t1 = span["ts"], span["ts"] + span["dur"]
    inside = [e for e in main if t0 <= e["ts"] and e["ts"] + e["dur"] <= t1 + 0.01 and e is not span]
    top_compute = [e for e in inside if e["cat"] == "compute" and not any(
        o is not e and o["cat"] == "compute" and o["ts"] <= e["ts"] and e["ts"] + e["dur"] <= o["ts"] + o["dur"]
        for o in inside)]
    exposed = [e for e in inside if e["cat"] == "comm.exposed"]
    in_compute = sum(x["dur"] for x in exposed if any(
        c["ts"] <= x["ts"] and x["ts"] + x["dur"] <= c["ts"] + c["dur"] for c in top_compute))
    out = {"step_time": span["dur"], "data": sum(e["dur"] for e in inside if e["cat"] == "data"),
           "exposed_comm": sum(e["dur"] for e in exposed),
           "compute": sum(e["dur"] for e in top_compute) - in_compute}
    out["idle"] = out["step_time"] - out["compute"] - out["exposed_comm"] - out["data"]
    return {k: v / 1e6 for k, v in out.items()}


def test_compute_exposed_comm_data_idle_add_up_to_the_step_time(traced):
    results, tr, metrics = traced
    assert sorted((m["rank"], m["step"]) for m in metrics) == [(r, s) for r in range(3) for s in range(STEPS)]
    for m in metrics:
        parts = m["compute"] + m["exposed_comm"] + m["data"] + m["idle"]
        assert parts == pytest.approx(m["step_time"], rel=1e-6)
        assert m["idle"] >= -0.02 * m["step_time"] and m["exposed_comm"] > 0 and m["compute"] > 0, m
        # the same numbers again from the merged timeline's spans alone, within 2% of the step
        derived = _breakdown_from_trace(tr["traceEvents"], m["rank"], m["step"])
        for key in ("step_time", "compute", "exposed_comm", "data", "idle"):
            assert abs(derived[key] - m[key]) <= 0.02 * m["step_time"], (key, derived, m)
        assert m["bytes"]["all_reduce"] > 4096 * 4 and m["samples"] == 16 and "loss" in m
    # the script's own clock agrees: its steps 1..STEPS-2 (step 0 also timed the loader's
    # start, the last step's span runs on to the end of the script's send/recv)
    for rank in range(3):
        mine = sum(results[rank]["times"][1:-1])
        traced_time = sum(m["step_time"] for m in metrics
                          if m["rank"] == rank and 1 <= m["step"] < STEPS - 1)
        assert traced_time == pytest.approx(mine, rel=0.02)


@pytest.fixture(scope="module")
def ring(jobs):
    _, directory, results = jobs
    return [r["ring"] for r in results], analysis.load(str(directory))


def test_ring_algorithm_waits_are_exposed_communication_and_the_parts_add_up(ring):
    results, run = ring
    events, metrics = run["events"], run["metrics"]
    assert trace.problems({"traceEvents": events}) == [] and results[0]["buckets"] == 2
    assert sorted((m["rank"], m["step"]) for m in metrics) == [(r, s) for r in range(WORLD) for s in range(STEPS)]
    for m in metrics:
        assert m["exposed_comm"] > 0 and m["bytes"]["all_reduce[ring]"] > 3e6, m  # waited on its future
        derived = _breakdown_from_trace(events, m["rank"], m["step"])
        for key in ("step_time", "compute", "exposed_comm", "data", "idle"):
            assert abs(derived[key] - m[key]) <= 0.02 * m["step_time"], (key, derived, m)
        assert m["tokens"] == 16 * 8 and m["tokens_per_s"] == pytest.approx(128 / m["step_time"])
    waits = [e for e in events if e["ph"] == "X" and e["name"] == "wait all_reduce[ring]"]
    assert waits and all(e["tid"] == 0 and e["cat"] == "comm.exposed" for e in waits)


def test_ring_buckets_are_spans_and_the_late_one_gets_a_computed_bucket_mb(ring):
    _, run = ring
    events = run["events"]
    for pid in range(WORLD):
        dp = sorted((e for e in events if e["pid"] == pid and e.get("cat") == "dp"), key=lambda e: e["ts"])
        assert [e["name"] for e in dp if e["name"] != "reduce"] == ["bucket 0", "bucket 1"] * STEPS
    timing = commstats.bucket_timing(events)
    assert timing["ready_at"] > 0.75 and timing["largest"] > 3e6 and timing["rate"] > 0, timing
    advice = commstats.bucket_advice(events)
    mb = float(advice.split("bucket_mb=")[1].split()[0])
    assert advice.startswith("buckets fire late: ") and 0 < mb * 2**20 <= 1.05 * timing["bytes"] / 4, advice
    lines = analysis.diagnose(run)  # named unless a straggler (load noise) explains the waits
    assert any(advice in x for x in lines) or lines[0].startswith("rank "), lines


def test_collectives_are_compared_with_the_link_the_ranks_were_given(ring):
    _, run = ring
    assert run["other"]["link_gbps"] == 10.0
    assert all(p["link_gbps"] == 10.0 for p in run["other"]["processes"])
    rows = [r for r in commstats.collectives(run["events"], run["other"]) if r["op"] == "all_reduce[ring]"]
    assert rows and len({r["bytes"] for r in rows}) == len(rows)  # one row per bucket size
    for row in rows:
        assert row["n"] == WORLD and row["bus_gbps"] > 0
        assert row["link_share"] == pytest.approx(row["bus_gbps"] / 10.0)
        assert row["bus_gbps"] == pytest.approx(8e-3 * row["bytes"] * 4 / 3 / row["median_us"])  # 2(n-1)/n
