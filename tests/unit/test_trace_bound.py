"""What bound each traced collective (`disttrain report`), from comm/cost.py's model over the
cost inputs the trace recorded: synthetic trace data, the recorder's header, the report."""

import json

import pytest

from disttrain import settings
from disttrain.plan import bound
from disttrain.trace import commstats, report
from disttrain.trace.recorder import cost_meta


def _meta(link=1.0, **cost):
    cost = {"cpus": 2, "local_ranks": 1, "shared_cpu": True, **cost}
    procs = [{"rank": r, "pid": r, "node": r, "link_gbps": link, "cost": cost} for r in range(2)]
    return {"processes": procs, "link_gbps": link}


def _events(nbytes, name="all_reduce"):
    return [{"ph": "X", "cat": "comm", "name": name, "pid": r, "tid": 100, "ts": 0.0, "dur": 2000.0,
             "args": {"bytes": nbytes, "ranks": 2, "group": "world"}} for r in range(2)]


def _verdict(nbytes, meta, name="all_reduce"):
    rows = commstats.collectives(_events(nbytes, name), meta)
    (v,), note = bound.judge(rows, meta)
    return v, note


def test_verdict_goes_latency_to_bandwidth_as_the_message_grows_on_a_fixed_link():
    meta = _meta(link=1.0)  # 2 nodes of 1 rank, 1 Gbit/s, the machine's whole CPU pool
    small, note = _verdict(1e5, meta)
    large, _ = _verdict(1e7, meta)
    assert small["bound"] == "latency" and large["bound"] == "bandwidth"
    # the ring of 2 ranks: 2 steps of half the tensor over the 1 Gbit/s link
    assert large["parts_us"]["bandwidth"] == pytest.approx(2 * 0.5e7 / 125e6 * 1e6)
    assert "link rate" in note.split(";")[0] and "alpha" in note.split(";")[1]


def test_verdict_is_cpu_when_the_node_quota_makes_the_pool_the_binding_term():
    free, _ = _verdict(1e6, _meta())
    quota, note = _verdict(1e6, _meta(node_cpus=0.5))  # 2 nodes x 0.5 of 2 CPUs: half the pool
    assert free["bound"] == "bandwidth" and quota["bound"] == "cpu"
    assert quota["parts_us"]["latency"] > free["parts_us"]["latency"]  # per-sender CPU time x2
    assert "CPU quota 0.5 cores per node of 2 CPUs" in note


def test_recorded_model_numbers_replace_the_fit_and_algorithms_are_read_from_the_name():
    v, note = _verdict(1e5, _meta(alpha_us=10.0, step_us=0.0, cpu_gbps=100.0, cpu_local_gbps=100.0))
    assert v["parts_us"]["latency"] == pytest.approx(2 * 10.0) and v["bound"] == "bandwidth"
    assert "alpha" in note.split(";")[0] and "CPU pool rate" in note.split(";")[0]
    assert bound.model_op("all_reduce[tree]") == ("all-reduce", "tree")
    assert bound.model_op("all_reduce") == ("all-reduce", "ring")  # gloo's own: modelled as ring
    assert bound.model_op("all_gather_into_tensor") == ("all-gather", "ring")
    assert bound.model_op("barrier") is None
    tree, _ = _verdict(1e7, _meta(), "all_reduce[tree]")
    assert tree["algorithm"] == "tree" and tree["predicted_us"] > _verdict(1e7, _meta())[0]["predicted_us"]


def test_recorder_header_holds_the_cost_inputs_it_knows():
    env = {"LOCAL_WORLD_SIZE": "2", settings.CLUSTER_CPUS: "0.5", settings.STEP_US: "184",
           settings.SHARED_CPU: "1", settings.LINK_GBPS: "1"}
    got = cost_meta(settings.Settings.from_env(env), env)
    assert got["local_ranks"] == 2 and got["node_cpus"] == 0.5 and got["step_us"] == 184.0
    assert got["shared_cpu"] is True and got["cpus"] >= 1
    assert "cpu_gbps" not in got and "alpha_us" not in got  # unset: the report's defaults


def test_report_names_the_bound_in_its_diagnosis_and_table(tmp_path):
    meta = _meta(node_cpus=0.5)
    trace = {"traceEvents": _events(1e5), "otherData": meta}
    (tmp_path / "trace.json").write_text(json.dumps(trace))
    page, lines = report.write_report(str(tmp_path), bound=bound)
    said = [x for x in lines if " is latency-bound in the cost model" in x]
    assert said and said[0].startswith("all_reduce of 0.10 MB over 2 ranks"), lines
    assert lines[-1].startswith("cost inputs recorded in the trace: CPU quota")
    html = open(page).read()
    assert "bound by (model ms)" in html and "latency (" in html
    _, plain = report.write_report(str(tmp_path))  # without the model: as before
    assert not any("-bound" in x for x in plain)


def test_each_message_size_gets_its_own_row_and_verdict():
    meta = _meta()
    events = _events(4) + _events(1e7)  # a loss all-reduce and a gradient bucket
    rows = commstats.collectives(events, meta)
    verdicts, _ = bound.judge(rows, meta)
    assert [(r["bytes"], v["bound"]) for r, v in zip(rows, verdicts)] == [(4, "latency"), (1e7, "bandwidth")]
