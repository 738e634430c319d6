"""How the launcher picks the cause of a failed job, without processes.

Error files are written by `_entry.record` from real exceptions, as a rank writes them;
flight states by real recorders; torch elastic's ProcessFailure reads them back.
"""

from __future__ import annotations

import io
import signal

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from disttrain.comm.flight import FlightRecorder
from disttrain.comm.ops import CollectiveError
from disttrain.launch import entry as _entry
from disttrain.launch.failures import classify, report_failures


def raised(exc: BaseException) -> BaseException:
    """`exc` with a traceback, as a rank's script would leave it."""
    try:
        raise exc
    except BaseException as err:  # noqa: BLE001
        return err


def peer_lost(rank: int) -> CollectiveError:
    rec = FlightRecorder(rank, 2, timeout=60)
    entry = rec.start("all_reduce", "world", [0, 1], [[4]], "float32")
    try:
        try:
            raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234")
        except RuntimeError as err:
            raise CollectiveError(rec.fail(entry, err), entry, False) from err
    except CollectiveError as err:
        return err


def failure(tmp_path, rank: int, exitcode: int, exc: BaseException | None, when: float,
            monkeypatch) -> ProcessFailure:
    path = tmp_path / f"error{rank}.json"
    if exc is not None:
        monkeypatch.setattr(_entry.time, "time", lambda: when)
        assert _entry.record(exc, __file__, str(path))
    return ProcessFailure(rank, 1000 + rank, exitcode, str(path))


def flying(report_dir, rank: int, world: int, op: str = "all_reduce") -> None:
    """A flight state of `rank` waiting in `op` #2 (after one completed)."""
    rec = FlightRecorder(rank, world, timeout=60, report_dir=str(report_dir))
    rec.end(rec.start(op, "world", list(range(world)), [[4]], "float32"))
    rec.start(op, "world", list(range(world)), [[4]], "float32")
    rec.write_state()


def test_cause_stopped_while_exiting_is_still_the_cause(tmp_path, monkeypatch):
    """The race of issue 9: rank 1 raised, rank 0 saw its peer leave and ended first, so
    the agent stopped rank 1 (SIGTERM) while it ran its exit handlers."""
    reports = tmp_path / "reports"
    reports.mkdir()
    flying(reports, 0, 2)
    failures = {
        0: failure(tmp_path, 0, 1, peer_lost(0), 100.4, monkeypatch),
        1: failure(tmp_path, 1, -signal.SIGTERM, raised(ValueError("bad batch")), 100.0, monkeypatch),
    }
    out = io.StringIO()
    assert report_failures(failures, out, str(reports), 2) == 1
    lines = out.getvalue().splitlines()
    assert lines[0] == "disttrain run: rank 1 raised an exception (pid 1001):"
    assert lines[1] == "[rank1]: Traceback (most recent call last):"
    assert "[rank1]: ValueError: bad batch" in lines
    assert lines[-1].startswith("disttrain run: rank 1 exited (exception) while rank 0 waited in "
                                "all_reduce #2 (test_failures.py:")
    assert "Connection closed" not in out.getvalue() and "timed out" not in out.getvalue()


def test_an_exception_beats_an_earlier_peer_lost_and_a_later_one_is_also_named(tmp_path, monkeypatch):
    failures = {
        0: failure(tmp_path, 0, 1, peer_lost(0), 99.0, monkeypatch),
        1: failure(tmp_path, 1, 1, raised(KeyError("k")), 100.5, monkeypatch),
        2: failure(tmp_path, 2, 1, raised(ValueError("v")), 100.0, monkeypatch),
        3: failure(tmp_path, 3, -signal.SIGTERM, None, 101.0, monkeypatch),
    }
    out = io.StringIO()
    assert report_failures(failures, out, None, 4) == 1
    text = out.getvalue()
    assert text.startswith("disttrain run: rank 2 raised an exception (pid 1002):\n")
    assert "disttrain run: rank 1 also failed: KeyError: 'k'\n" in text
    assert text.endswith("disttrain run: stopped ranks 0,3 after rank 2 failed\n")


@pytest.mark.parametrize("exc,exitcode,kind,code", [
    (SystemExit(3), 3, "exit", 3),
    (SystemExit("no data"), -signal.SIGTERM, "exit", 1),
    (None, -signal.SIGKILL, "signal", 128 + 9),
    (None, 5, "code", 5),
    (None, 124, "timeout", 124),
    (None, -signal.SIGTERM, "stopped", 1),
])
def test_kind_and_exit_code_follow_what_was_recorded(tmp_path, monkeypatch, exc, exitcode, kind, code):
    f = classify(1, failure(tmp_path, 1, exitcode, exc and raised(exc), 1.0, monkeypatch))
    assert (f.kind, f.code) == (kind, code)


def test_a_timeout_without_a_cause_prints_the_hang_report(tmp_path, monkeypatch):
    reports = tmp_path / "reports"
    reports.mkdir()
    flying(reports, 0, 2)
    rec = FlightRecorder(0, 2, timeout=5, report_dir=str(reports))
    entry = rec.start("all_reduce", "world", [0, 1], [[4]], "float32")
    timeout = raised(CollectiveError(rec.fail(entry, TimeoutError("timed out")), entry, True))
    failures = {0: failure(tmp_path, 0, 124, timeout, 1.0, monkeypatch),
                1: failure(tmp_path, 1, -signal.SIGTERM, None, 2.0, monkeypatch)}
    out = io.StringIO()
    assert report_failures(failures, out, str(reports), 2) == 124
    assert out.getvalue().startswith("disttrain run: a collective timed out after 5 s; where every rank was:")


def test_a_peer_that_left_without_failing_is_not_called_a_timeout(tmp_path, monkeypatch):
    reports = tmp_path / "reports"
    reports.mkdir()
    flying(reports, 0, 2)
    failures = {0: failure(tmp_path, 0, 1, peer_lost(0), 1.0, monkeypatch)}
    out = io.StringIO()
    assert report_failures(failures, out, str(reports), 2) == 1
    assert out.getvalue().startswith(
        "disttrain run: a collective failed because a rank left the job; where every rank was:")


@pytest.mark.parametrize("exc,kind", [
    (RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:5"), "peer-lost"),
    (RuntimeError("[unbound_buffer.cc:81] Timed out waiting 5000ms for recv operation"), "timeout"),
    (TimeoutError("the data loader timed out"), "exception"),  # the user's own, not a collective
    (ValueError("Connection closed by peer"), "exception"),
    (SystemExit(2), "exit"),
])
def test_failure_kind_of_raw_backend_errors(exc, kind):
    assert _entry.failure_kind(exc) == kind


def test_failure_kind_looks_through_the_exception_chain():
    try:
        try:
            raise RuntimeError("Connection reset by peer")
        except RuntimeError as err:
            raise ValueError("my loop failed") from err
    except ValueError as err:
        assert _entry.failure_kind(err) == "peer-lost"


def test_a_rank_stopped_before_its_first_heartbeat_is_placed_by_its_live_file(tmp_path):
    """The flake of issue 21: rank 1 was SIGKILLed and the agent stopped rank 0 before its
    watchdog wrote any state. Where rank 0 waits is in its live file from the moment the
    collective started, so the report names it anyway."""
    reports = tmp_path / "reports"
    reports.mkdir()
    rec = FlightRecorder(0, 2, timeout=60, report_dir=str(reports), interval=3600)
    rec.end(rec.start("all_reduce", "world", [0, 1], [[4]], "float32"))
    rec.start("all_reduce", "world", [0, 1], [[4]], "float32")
    assert not (reports / "rank0.a0.json").exists()  # no heartbeat, no write_state
    failures = {0: ProcessFailure(0, 1000, -signal.SIGTERM, str(tmp_path / "none0.json")),
                1: ProcessFailure(1, 1001, -signal.SIGKILL, str(tmp_path / "none1.json"))}
    out = io.StringIO()
    assert report_failures(failures, out, str(reports), 2) == 128 + signal.SIGKILL
    lines = out.getvalue().splitlines()
    assert lines[0] == "disttrain run: rank 1 was killed by SIGKILL (pid 1001)", lines
    assert lines[-1].startswith("disttrain run: rank 1 was killed by SIGKILL while rank 0 waited in "
                                "all_reduce #2 (test_failures.py:"), lines
    assert "stopped rank 0" not in out.getvalue()


def test_the_live_file_beats_a_stale_heartbeat(tmp_path):
    """A heartbeat written while rank 0 waited in #1 is stale once #1 completed and #2
    started; the report says #2, as the live file does."""
    reports = tmp_path / "reports"
    reports.mkdir()
    rec = FlightRecorder(0, 2, timeout=60, report_dir=str(reports), interval=3600)
    first = rec.start("all_reduce", "world", [0, 1], [[4]], "float32")
    rec.write_state()
    rec.end(first)
    rec.start("broadcast", "world", [0, 1], [[4]], "float32")
    failures = {0: ProcessFailure(0, 1000, -signal.SIGTERM, str(tmp_path / "none0.json")),
                1: ProcessFailure(1, 1001, -signal.SIGKILL, str(tmp_path / "none1.json"))}
    out = io.StringIO()
    report_failures(failures, out, str(reports), 2)
    assert "while rank 0 waited in broadcast #2 (test_failures.py:" in out.getvalue(), out.getvalue()
