"""The flight recorder on real gloo ranks: numbering, call sites, timeouts, the watchdog.

Rank functions live in this module (spawn finds them by name). Line numbers of the
calls they make are found by their `# at:NAME` markers, so the tests check the call
site the recorder captured against this very file.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import disttrain
from disttrain import comm
from disttrain.launch.hang_report import collective_report
from disttrain.testing import RankFailedError, spawn

HERE = Path(__file__)


def line_of(marker: str) -> int:
    for n, line in enumerate(HERE.read_text().splitlines(), 1):
        if line.rstrip().endswith(f"# at:{marker}"):
            return n
    raise AssertionError(marker)


def every_op():
    rank = dist.get_rank()
    t = torch.full((3,), float(rank + 1))
    comm.all_reduce(t)  # at:ar
    comm.broadcast(t, src=1)  # at:bc
    parts = [torch.empty(3) for _ in range(2)]
    comm.all_gather(parts, t)  # at:ag
    comm.all_reduce(torch.ones(2, 5), async_op=True).wait()  # at:async
    pair = dist.new_group([0, 1])
    comm.barrier(group=pair)  # at:sub
    if rank == 0:
        comm.send(torch.arange(4.0), dst=1)  # at:send
    else:
        got = torch.empty(4)
        comm.recv(got, src=0)  # at:recv
    rec = comm.recorder()
    return {"t": t, "state": rec.snapshot(), "flying": len(rec.in_flight())}


def nonfinite_on_rank_one():
    torch.manual_seed(0)
    model = disttrain.DataParallel(nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1)), check_finite=True)
    x = torch.ones(4, 3)
    if dist.get_rank() == 1:
        x[0, 0] = float("nan")  # only rank 1's batch is bad; averaging would spread it
    try:
        model(x).sum().backward()
    except disttrain.NonFiniteGradError as err:
        return {"msg": str(err), "bad": {str(k): v for k, v in err.bad.items()}}
    return None


def every_op_then_late(flag: str):
    out = every_op()
    out["nonfinite"] = nonfinite_on_rank_one()
    world = [e for e in comm.recorder().snapshot()["recent"] if e["group"] == "world"]
    out["next_seq"] = world[-1]["seq"] + 1
    if dist.get_rank() == 1:  # stay alive (not in a collective) until rank 0 gave up
        deadline = time.monotonic() + 30
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.05)
        return out
    try:
        comm.all_reduce(torch.ones(2))  # at:late
    except comm.CollectiveError as err:
        out["late"] = {"msg": str(err), "timed_out": err.timed_out, "exit": err.disttrain_exit_code,
                       "status": comm.recorder().status}
    finally:
        Path(flag).touch()
    return out


@pytest.mark.timeout(60)
def test_collectives_numbered_and_placed_nan_named_by_rank_and_timeout_names_call_site(tmp_path):
    out = spawn(every_op_then_late, 2, str(tmp_path / "flag"), collective_timeout=2,
                env={"DISTTRAIN_TIMEOUT": "2"})
    for rank, res in enumerate(out):
        torch.testing.assert_close(res["t"], torch.full((3,), 3.0))
        assert res["flying"] == 0 and res["state"]["status"] == "running"
        assert res["state"]["timeout"] == 2.0
        got = [(e["op"], e["group"], e["seq"], e["shapes"], e["site"]) for e in res["state"]["recent"]]
        p2p = ("send", [[4]], "send") if rank == 0 else ("recv", [[4]], "recv")
        want = [
            ("all_reduce", "world", 1, [[3]], "ar"),
            ("broadcast", "world", 2, [[3]], "bc"),
            ("all_gather", "world", 3, [[3]], "ag"),
            ("all_reduce", "world", 4, [[2, 5]], "async"),
            ("barrier", "group [0-1]", 1, [], "sub"),
            (p2p[0], "p2p 0->1", 1, p2p[1], p2p[2]),
        ]
        assert got == [(op, g, s, sh, f"{HERE}:{line_of(m)}") for op, g, s, sh, m in want]
        # every rank stops together, told which parameters went bad on which rank
        assert res["nonfinite"]["bad"] == {"1": ["0.weight", "1.weight"]}, res["nonfinite"]
        assert "rank 1: 0.weight, 1.weight" in res["nonfinite"]["msg"]
    late = out[0]["late"]  # rank 1 never joined: gloo gave up after 2 s
    assert late["timed_out"] and late["status"] == "timeout" and late["exit"] == 124
    assert late["msg"].startswith(f"all_reduce #{out[0]['next_seq']} (test_hang_recorder.py:{line_of('late')}) on "
                                  "world (ranks 0-1) did not complete within 2 s on rank 0")
    assert "--timeout" in late["msg"]


def skip_on_subgroup(report_dir):
    # NOTE: a new_group gets torch's 30-minute default timeout, so gloo would wait that
    # long; only the recorder's watchdog ends this hang.
    pair = dist.new_group([0, 1])
    comm.barrier(group=pair)
    if dist.get_rank() == 0:
        comm.all_reduce(torch.ones(2), group=pair)  # at:stuck
    time.sleep(30)


@pytest.mark.timeout(60)
def test_watchdog_ends_a_hang_the_backend_would_wait_30_minutes_for(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="exit code 124") as info:
        spawn(skip_on_subgroup, 2, str(tmp_path), timeout=40,
              env={"DISTTRAIN_TIMEOUT": "2", "DISTTRAIN_REPORT_DIR": str(tmp_path)})
    assert info.value.rank == 0
    assert time.monotonic() - start < 30  # 2 s timeout + 2 s grace + start-up
    report = collective_report(str(tmp_path), {0: 124}, 2)
    stuck = line_of("stuck")
    assert f"all_reduce #2 (test_hang_recorder.py:{stuck}) on group [0-1] (ranks 0-1): rank 0 " \
           "waited; missing: rank 1" in report, report
    assert "[rank0]: watchdog: all_reduce #2" in report
    assert f'[rank0]:   File "{HERE}", line {stuck}, in skip_on_subgroup' in report.splitlines()
    assert os.path.exists(tmp_path / "rank1.a0.json")  # the heartbeat of the healthy rank
