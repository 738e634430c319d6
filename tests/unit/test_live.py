"""The live file (comm/live.py): what a rank waits in, on disk while it waits."""

from __future__ import annotations

from disttrain.comm.flight import FlightRecorder, report_path
from disttrain.comm.live import SLOT_BYTES, SLOTS, LiveSlots, parse_ranks, read_live


def test_start_writes_the_wait_and_end_clears_it_without_a_heartbeat(tmp_path):
    rec = FlightRecorder(3, 4, timeout=60, report_dir=str(tmp_path), attempt=2, interval=3600)
    path = report_path(str(tmp_path), 3, 2, "live")
    a = rec.start("all_reduce", "world", [0, 1, 2, 3], [[4]], "float32")
    b = rec.start("broadcast", "group [0-1,3]", (0, 1, 3), [[2]], "float32")
    flying = read_live(path)
    assert [(e["op"], e["seq"], e["group"], e["ranks"]) for e in flying] == [
        ("all_reduce", 1, "world", [0, 1, 2, 3]), ("broadcast", 1, "group [0-1,3]", [0, 1, 3])]
    assert flying[0]["site"] == a.site and flying[0]["func"] == a.func
    rec.end(a)
    assert [e["op"] for e in read_live(path)] == ["broadcast"]
    rec.end(b)
    assert read_live(path) == []


def test_slots_are_reused_a_full_file_drops_the_newest_and_long_sites_keep_their_tail(tmp_path):
    live = LiveSlots(str(tmp_path / "x.live"))
    slots = [live.put(i, i, "send", "p2p 0->1", "0-1", "f", "a.py:1") for i in range(SLOTS)]
    assert sorted(slots) == list(range(SLOTS))
    assert live.put(99, 99, "send", "p2p 0->1", "0-1", "f", "a.py:1") == -1
    live.clear(slots[5])
    site = "/" + "d" * 2 * SLOT_BYTES + "/train.py:42"
    assert live.put(100, 100, "recv", "p2p 1->0", "0-1", "f", site) == slots[5]
    flying = read_live(str(tmp_path / "x.live"))
    assert len(flying) == SLOTS and flying[-1]["site"].endswith("/train.py:42")
    assert read_live(str(tmp_path / "missing.live")) is None


def test_parse_ranks_inverts_format_ranks():
    assert parse_ranks("0-2,5,7-8") == [0, 1, 2, 5, 7, 8] and parse_ranks("") == []
