"""The flight recorder and the merged hang report without processes.

The recorder is driven by hand (start/end, a short timeout, a fake hang handler); the
report is built from state files written by real recorders into tmp_path, plus a
faulthandler dump of a real stopped process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from disttrain.comm.flight import FlightRecorder, format_ranks, report_path
from disttrain.launch.hang_report import collective_report, load_states


def test_format_ranks_collapses_runs():
    assert format_ranks([3, 0, 1, 2, 5, 7, 8]) == "0-3,5,7-8"
    assert format_ranks([4]) == "4"


def record(rec: FlightRecorder, op: str, done: bool = True):
    entry = rec.start(op, "world", list(range(rec.world_size)), [[4]], "float32")
    if done:
        rec.end(entry)
    return entry


@pytest.mark.timeout(30)
def test_watchdog_reports_an_overdue_collective_with_every_threads_stack(tmp_path):
    hung = threading.Event()
    rec = FlightRecorder(1, 2, timeout=0.2, report_dir=str(tmp_path), grace=0.1, interval=0.02,
                         on_hang=lambda entry: hung.set())
    record(rec, "all_reduce")
    entry = record(rec, "broadcast", done=False)  # never completes
    rec.start_watchdog()
    assert hung.wait(10)
    state = json.loads(open(report_path(str(tmp_path), 1, 0)).read())
    assert state["status"] == "timeout" and state["error"] == f"watchdog: {entry.describe()} overdue"
    assert [(e["op"], e["seq"]) for e in state["in_flight"]] == [("broadcast", 2)]
    assert [(e["op"], e["seq"]) for e in state["recent"]] == [("all_reduce", 1)]
    assert entry.site == f"{os.path.abspath(__file__)}:{record.__code__.co_firstlineno + 1}"
    assert "test_watchdog_reports_an_overdue" in state["stacks"]["MainThread"]


@pytest.mark.timeout(30)
def test_heartbeat_writes_only_changes_and_no_hang_without_overdue(tmp_path):
    rec = FlightRecorder(0, 1, timeout=5, report_dir=str(tmp_path), interval=0.02,
                         on_hang=lambda entry: pytest.fail("no collective is overdue"))
    rec.start_watchdog()
    record(rec, "barrier")
    path = report_path(str(tmp_path), 0, 0)
    deadline = time.monotonic() + 10
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert json.loads(open(path).read())["recent"][0]["op"] == "barrier"
    rec.finish()
    assert json.loads(open(path).read())["status"] == "exited"


def write_state(tmp_path, rank, world, ops, flying=None, attempt=0, status="running"):
    rec = FlightRecorder(rank, world, timeout=5, report_dir=str(tmp_path), attempt=attempt)
    for op in ops:
        record(rec, op)
    if flying:
        record(rec, flying, done=False)
    rec.status = status
    rec.write_state()


def test_report_names_missing_rank_and_the_call_it_skipped(tmp_path):
    write_state(tmp_path, 0, 3, ["all_reduce"], flying="all_reduce", status="timeout")
    write_state(tmp_path, 1, 3, ["all_reduce"], flying="all_reduce", status="timeout")
    write_state(tmp_path, 2, 3, ["all_reduce"], status="exited")
    write_state(tmp_path, 2, 3, ["all_reduce"] * 5, attempt=-1)  # an older attempt: ignored
    report = collective_report(str(tmp_path), {0: 124, 1: 124}, 3)
    site = f"test_hang_report.py:{record.__code__.co_firstlineno + 1}"
    assert f"all_reduce #2 ({site}) on world (ranks 0-2): ranks 0-1 waited; missing: rank 2" in report
    assert f"all_reduce at {site} was issued 2 times by ranks 0-1 but once by rank 2" in report
    assert (f"ranks 0-1 are at all_reduce #2 ({site}); rank 2 is done: its script returned "
            f"(last completed all_reduce #1 ({site}))") in report


def test_no_report_when_no_collective_failed(tmp_path):
    write_state(tmp_path, 0, 2, ["all_reduce"])
    write_state(tmp_path, 1, 2, ["all_reduce"])
    assert collective_report(str(tmp_path), {1: 1}, 2) is None


@pytest.mark.timeout(30)
def test_faulthandler_dump_of_a_stopped_rank_gives_its_main_thread_stack(tmp_path):
    """A real process with a busy helper thread, stopped by SIGTERM like the launcher does."""
    entry = os.path.join(os.path.dirname(__import__("disttrain").__file__), "launch", "entry.py")
    script = tmp_path / "sleepy.py"
    script.write_text("import threading, time\n"
                      "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
                      "def nap():\n"
                      "    time.sleep(60)\n"
                      "open(__file__ + '.ready', 'w').close()\n"
                      "nap()\n")
    env = dict(os.environ, DISTTRAIN_REPORT_DIR=str(tmp_path), RANK="1", TORCHELASTIC_RESTART_COUNT="0")
    proc = subprocess.Popen([sys.executable, entry, str(script)], env=env)
    deadline = time.monotonic() + 20
    while not os.path.exists(f"{script}.ready") and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == -signal.SIGTERM  # the dump does not keep the rank alive
    write_state(tmp_path, 0, 2, [], flying="all_reduce", status="timeout")
    _, _, faults = load_states(str(tmp_path))
    assert 1 in faults
    report = collective_report(str(tmp_path), {0: 124, 1: -15}, 2)
    assert "rank 1 is outside any disttrain collective at sleepy.py:4 in nap (it issued none)" in report
    lines = report.splitlines()
    i = lines.index("[rank1]: stack (most recent call last):")
    assert lines[i + 1:i + 3] == [f'[rank1]:   File "{script}", line 6, in <module>',
                                  f'[rank1]:   File "{script}", line 4, in nap']


def test_point_to_point_is_numbered_per_direction_and_a_send_meets_its_recv(tmp_path):
    def p2p(rank, op, flying):
        rec = FlightRecorder(rank, 3, timeout=5, report_dir=str(tmp_path))
        for _ in range(2):
            rec.end(rec.start(op, "p2p 0->1", (0, 1), [[8]], "float32"))
        if flying:
            rec.start(op, "p2p 0->1", (0, 1), [[8]], "float32")
        rec.status = "timeout" if flying else "running"
        rec.write_state()

    p2p(0, "isend", flying=True)  # message #3 from 0 to 1 is posted by both sides
    p2p(1, "irecv", flying=True)
    p2p(2, "barrier", flying=False)
    report = collective_report(str(tmp_path), {0: 124, 1: 124}, 3)
    assert "mismatch" not in report
    assert "isend #3 (test_hang_report.py" in report and "on p2p 0->1 (ranks 0-1): rank 0 waited" in report
    assert "irecv #3" in report
