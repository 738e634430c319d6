"""The server manager: its state machine (ps/membership.py, pure) and the live process
(ps/manager.py) on the authenticated wire, driven by real `ManagerLink`s over ZeroMQ.

Membership changes are one ring version each, refused with a reason and a fix where they
would lose data or mix jobs, asked on the current version only (compare and set); a
silent server is marked dead within its timeout, by name; a party holding an old version
is told so and gets the current ring; frames that break the manager ops' schema are
refused, counted and answered naming op and field, and the manager keeps serving; a
manager killed with SIGKILL and started again on its state file answers at the same
address with the same version and members, and the parties' links reconnect by
themselves. A wrong secret or a missing manager is an error within the link's timeout.
"""

import json
import os
import signal
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disttrain import cli
from disttrain import settings as ds
from disttrain.ps import manager
from disttrain.ps.cli import format_status
from disttrain.ps.frame import Message
from disttrain.ps.manager_link import (
    SERVER_PARTY,
    Heartbeat,
    ManagerError,
    ManagerLink,
    lookup_addresses,
)
from disttrain.ps.membership import MANAGER_INDEX, Membership, Refused, Stale
from disttrain.ps.membership_file import from_json, save

KEY = bytes(range(32))
SHARD0 = [["a", 400, [0]], ["b", 100, [0]]]
SHARD1 = [["c", 300, [1]]]


def _two(now: float = 0.0) -> Membership:
    m = Membership()
    assert m.register(0, "ipc://s0", "fp", 2, SHARD0, now)
    assert not m.complete()
    assert m.register(1, "ipc://s1", "fp", 2, SHARD1, now)
    return m


# ---- the state machine, pure --------------------------------------------------------
def test_every_membership_change_is_one_version_and_heartbeats_are_none():
    m = _two()
    assert m.version == 2 and m.complete()
    assert not m.register(0, "ipc://s0", "fp", 2, SHARD0, 1.0)  # the same again: no change
    assert not m.beat(0, version=7, pushes=40, final=False, now=2.0)
    assert m.version == 2 and m.members[0].rate == pytest.approx(40 / 1.0)
    assert m.register(0, "ipc://s0-new", "fp", 2, SHARD0, 3.0)  # restarted: a new address
    assert m.version == 3 and "server 0 came back (alive at ipc://s0)" in m.events[-1]
    assert m.register(1, "ipc://s1", "fp", 2, SHARD1, 3.0, attempt=1)  # a launcher restart
    assert m.version == 4 and m.ring_rows()[1] == {"server": 1, "address": "ipc://s1",
                                                   "state": "alive", "attempt": 1}
    assert m.join(2, "ipc://s2", "fp", ring=4, now=3.0) and m.version == 5
    assert m.members[2].state == "joining"  # keys move to it (join_moves.py, test_ps_join.py)


def test_refusals_name_the_reason_and_the_fix():
    m = _two()
    with pytest.raises(Refused, match="another model or policy.*same model and policy"):
        m.register(0, "ipc://x", "other", 2, SHARD0, 0.0)
    with pytest.raises(Refused, match="launched with 3 servers, this group with 2"):
        m.register(1, "ipc://x", "fp", 3, SHARD1, 0.0)
    with pytest.raises(Refused, match="not one of the 2 servers.*joins instead"):
        m.register(5, "ipc://x", "fp", 2, [], 0.0)
    with pytest.raises(Refused, match="manager is not a server of the ring"):
        m.leave(MANAGER_INDEX, ring=2)
    one = Membership()
    one.register(0, "ipc://s0", "fp", 1, SHARD0, 0.0)
    with pytest.raises(Refused, match=r"server 0 holds the last live copy of 2 keys \(0.00 MB, "
                                      r"e.g. 'a'\) and no other server is alive to take them"):
        one.leave(0, ring=1)
    with pytest.raises(Refused, match="another model or policy"):
        m.join(3, "ipc://y", "other", ring=2, now=0.0)
    with pytest.raises(Refused, match="already a member.*e.g. 2"):
        m.join(1, "ipc://y", "fp", ring=2, now=0.0)
    with pytest.raises(Stale, match="leave asked on ring version 1, the current one is 2"):
        m.leave(1, ring=1)
    with pytest.raises(Refused, match="not registered with this manager"):
        m.beat(7, 0, 0, False, 0.0)
    assert m.version == 2  # nothing refused changed anything


def test_a_drain_with_replicas_1_moves_the_keys_first_then_the_server_leaves():
    m = _two()
    assert m.leave(0, ring=2) and m.members[0].state == "leaving" and m.version == 3
    assert ("server 0 at ipc://s0 is leaving: its 2 keys move to the placement without it "
            "(servers [1])") in m.events[-1]
    with pytest.raises(Refused, match="no other server is alive to take them"):
        m.leave(1, ring=3)  # the only server left to take them
    assert not m.beat(1, 5, 10, False, 1.0, accepting=0)  # ready to take server 0's keys
    assert m.accepting() == [[1, 0]] and m.version == 3
    assert m.beat(0, 5, 10, False, 1.0, drained=True)  # handed everything over
    assert m.members[0].state == "left" and m.version == 4
    assert "server 0 at ipc://s0 left: its keys moved" in m.events[-1]
    assert not m.beat(0, 5, 10, True, 2.0, drained=True)  # its last report: it stays left
    assert m.members[0].state == "left" and m.version == 4
    row = {"server": 0, "by": 1, "address": "ipc://r", "keys": 2, "bytes": 500, "version": 5,
           "after": 0.1}
    assert m.adopt(1, [row], 3.0) and m.version == 5
    assert "server 1 took over 2 keys (0.00 MB) of left server 0 at version 5" in m.events[-1]


def test_a_job_that_ends_before_the_drain_finished_says_so():
    m = _two()
    assert m.leave(0, ring=2) and m.members[0].state == "leaving"
    assert not m.beat(0, 9, 30, True, 1.0)  # its last report, nothing handed over
    assert m.members[0].state == "exited"
    assert m.events[-1] == ("server 0 exited (its job ended) at ring version 3: its drain had "
                            "not finished, its keys stayed on it to the end")


def test_a_drain_is_refused_while_another_is_under_way_and_with_chains_of_copies():
    m = Membership()
    for i in range(3):
        m.register(i, f"ipc://s{i}", "fp", 3, [[f"k{i}", 8, [i]]], 0.0)
    assert m.leave(0, ring=3) and m.members[0].state == "leaving"
    with pytest.raises(Refused, match="server 0 is still leaving: drain one server at a time"):
        m.leave(1, ring=4)
    assert m.beat(0, 1, 1, False, 1.0, drained=True) and m.members[0].state == "left"
    with pytest.raises(Refused, match="server 0's keys moved already: a second drain that "
                                      "moves keys is not built yet"):
        m.leave(1, ring=5)
    m = Membership()
    m.register(0, "ipc://s0", "fp", 3, [["a", 8, [0, 1]]], 0.0)
    m.register(1, "ipc://s1", "fp", 3, [["a", 8, [0, 1]]], 0.0)
    m.register(2, "ipc://s2", "fp", 3, [["b", 8, [2]]], 0.0)
    m.expire(20.0, 10.0)  # every server silent: all dead
    m.register(1, "ipc://s1b", "fp", 3, [["a", 8, [0, 1]]], 21.0)
    m.register(2, "ipc://s2b", "fp", 3, [["b", 8, [2]]], 21.0)
    with pytest.raises(Refused, match="its other copies are on servers no longer alive"):
        m.leave(1, ring=m.version)  # its copy's other holder is dead


def test_a_key_with_a_live_copy_elsewhere_is_handed_to_its_copies_then_the_server_leaves():
    m = Membership()
    for i in range(3):
        m.register(i, f"ipc://s{i}", "fp", 3, [["a", 8, [0, 1]], ["b", 8, [2, 1]]], 0.0)
    assert m.leave(0, ring=3) and m.members[0].state == "leaving" and m.version == 4
    assert ("server 0 at ipc://s0 is leaving: its 2 keys are served by their next live copies "
            "once it handed over (replicas >= 2)") in m.events[-1]
    with pytest.raises(Refused, match="server 0 is leaving, and with replicas >= 2 a drain "
                                      "comes first or not at all"):
        m.leave(2, ring=4)
    assert m.beat(0, 5, 10, False, 1.0, drained=True) and m.members[0].state == "left"
    assert "server 0 at ipc://s0 left: its copies serve its keys" in m.events[-1]
    row = {"server": 0, "by": 1, "address": "ipc://r", "keys": 1, "bytes": 8, "version": 5,
           "after": 0.1}
    assert m.adopt(1, [row], 2.0) and "of left server 0" in m.events[-1]
    with pytest.raises(Refused, match="server 0 is left, and with replicas >= 2"):
        m.leave(2, ring=m.version)  # a second change is not built
    m = Membership()
    m.register(0, "ipc://s0", "fp", 2, [["a", 8, [0, 1]]], 0.0)
    m.register(1, "ipc://s1", "fp", 2, [["a", 8, [0, 1]]], 0.0)
    assert m.leave(0, ring=2) and m.version == 3
    with pytest.raises(Refused, match="last live copy of 1 keys"):
        m.leave(1, ring=3)


def test_a_silent_server_is_marked_dead_by_name_in_bounded_time_and_may_come_back():
    m = _two(now=0.0)
    m.beat(1, 3, 9, False, now=2.5)
    assert m.expire(now=2.9, timeout=3.0) == []
    events = m.expire(now=3.1, timeout=3.0)
    assert len(events) == 1 and m.version == 3 and m.members[0].state == "dead"
    assert ("ring version 3: server 0 at ipc://s0 missed its heartbeats for 3.1 s (timeout "
            "3 s): marked dead; 2 keys have no other live copy") == events[0]
    assert not m.complete()
    assert m.beat(0, 5, 10, False, now=4.0) and m.version == 4 and m.complete()
    assert not m.beat(1, 6, 12, True, now=4.0) and m.members[1].state == "exited"
    assert m.expire(now=100.0, timeout=3.0) and m.members[1].state == "exited"


def test_the_state_file_is_json_written_atomically_and_reloads_the_same_ring(tmp_path):
    m = _two()
    m.beat(0, 3, 9, False, now=1.0)
    path = str(tmp_path / "m.json")
    save(m, path, {"address": "ipc://here"})
    assert os.listdir(tmp_path) == ["m.json"]  # no temporary file left
    text = open(path).read()
    assert json.loads(text)["address"] == "ipc://here"
    back = from_json(text, now=50.0)
    assert (back.version, back.expected, back.fingerprint) == (2, 2, "fp")
    assert back.ring_rows() == m.ring_rows() and back.members[0].shard == SHARD0
    assert back.members[0].beat == 50.0  # a full timeout again after a restart
    assert back.expire(now=52.0, timeout=3.0) == []
    with pytest.raises(ValueError, match="another disttrain version"):
        from_json(json.dumps({"format": 99}), 0.0)


# ---- the live manager -----------------------------------------------------------------
class Live:
    """A manager serving `state` on a thread of this process."""

    def __init__(self, state: str, timeout: float = 30.0):
        self.stop, got = threading.Event(), []
        self.thread = threading.Thread(target=manager.serve_manager, args=(state,), kwargs=dict(
            timeout=timeout, stop=self.stop, ready=got.append, secret=KEY))
        self.thread.start()
        while not got:
            time.sleep(0.005)
        self.address = got[0]

    def link(self, party: int, timeout: float = 5.0, secret: bytes = KEY) -> ManagerLink:
        return ManagerLink(self.address, party, timeout=timeout, secret=secret)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        assert not self.thread.is_alive()


def _register(link: ManagerLink, server: int, shard=(), expected: int = 2) -> Message:
    return link.request("register", server=server, address=f"ipc://s{server}", fingerprint="fp",
                        expected=expected, attempt=0,
                        shard=[{"key": k, "bytes": n, "chain": c} for k, n, c in shard])


@pytest.fixture
def live(tmp_path):
    m = Live(str(tmp_path / "manager.json"))
    yield m
    m.close()


@pytest.mark.timeout(30)
def test_a_worker_holding_an_old_ring_version_is_told_and_gets_the_new_ring(live):
    s0, s1 = live.link(SERVER_PARTY), live.link(SERVER_PARTY + 1)
    _register(s0, 0, SHARD0)
    _register(s1, 1, SHARD1)
    worker = live.link(0)
    ring = worker.request("lookup").meta
    assert (ring["version"], ring["complete"]) == (2, 1) and worker.ring["version"] == 2
    assert worker.request("lookup").meta["stale"] == 0
    # the ring moves on without the worker: a server comes back at a new address
    s1.request("register", server=1, address="ipc://s1-new", fingerprint="fp", expected=2,
               attempt=0, shard=[])
    with pytest.raises(ManagerError, match="leave asked on ring version 2, the current one is 3"):
        worker.request("leave", server=1)  # a change asked on the old version is refused
    ring = worker.request("lookup", ring=2).meta
    assert ring["stale"] == 1 and ring["version"] == 3 and worker.ring["version"] == 3
    assert ring["servers"][1]["address"] == "ipc://s1-new"
    ring = worker.request("leave", server=0).meta  # its keys move to server 1 first
    assert ring["version"] == 4 and ring["servers"][0]["state"] == "leaving"
    with pytest.raises(ManagerError, match="server 0 is not an alive member of ring version 4"):
        worker.request("leave", server=0)
    with pytest.raises(ManagerError, match="manager is not a server"):
        worker.request("leave", server=MANAGER_INDEX)
    state = live.link(1 << 30).request("status").meta
    text = format_status(state, live.address)
    assert "ring version 4: 1 of 2 servers alive" in text and " leaving " in text
    assert "a                                            0.000 MB  server 0  chain 0" in text
    assert "ring version 3: server 1 came back (alive at ipc://s1) at ipc://s1-new" in text


@pytest.mark.timeout(30)
def test_a_server_that_stops_beating_is_marked_dead_by_name(tmp_path):
    live = Live(str(tmp_path / "m.json"), timeout=0.6)
    try:
        beats = []
        for i in (0, 1):
            link = live.link(SERVER_PARTY + i)
            _register(link, i, SHARD0 if i == 0 else SHARD1)
            beats.append(Heartbeat(link, i, lambda i=i: (7 + i, 30), interval=0.1))
            beats[-1].start()
        time.sleep(0.3)
        beats[1]._quit.set()  # server 1 goes silent, as a killed one would
        start = time.monotonic()
        worker = live.link(0)
        while worker.request("lookup").meta["version"] < 3:
            assert time.monotonic() - start < 5, "server 1 never marked dead"
            time.sleep(0.05)
        state = live.link(1 << 30).request("status").meta
        assert [r["state"] for r in state["servers"]] == ["alive", "dead"]
        assert state["servers"][0]["version"] == 7 and state["servers"][0]["pushes"] == 30
        assert "server 1 at ipc://s1 missed its heartbeats" in state["events"][-1]
        beats[0].stop()  # the job ended: exited, no new version
        assert live.link(0).request("lookup").meta["version"] == 3
    finally:
        live.close()


@pytest.mark.timeout(20)
def test_a_wrong_secret_or_no_manager_is_a_clear_error_in_bounded_time(live, tmp_path):
    start = time.monotonic()
    with pytest.raises(ManagerError, match="no answer from the server manager at .* within "
                                           "0.5 s.*another DISTTRAIN_SECRET"):
        live.link(0, timeout=0.5, secret=bytes(32)).request("lookup")
    with pytest.raises(ManagerError, match="no server manager at ipc://.*no such socket"):
        ManagerLink(f"ipc://{tmp_path}/none.sock", 0, timeout=0.5, secret=KEY).request("status")
    assert time.monotonic() - start < 4


_BAD = {  # op -> (field, value) that breaks its schema
    "register": ("shard", [{"key": "a", "bytes": "9", "chain": [0]}]),
    "report": ("version", -1), "lookup": ("ring", "x"), "join": ("address", 5),
    "leave": ("server", True), "status": ("extra", 1)}


@pytest.mark.timeout(60)
@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(st.sampled_from(sorted(_BAD)) | st.sampled_from(["push", "ring", "hello"]),
                min_size=1, max_size=4))
def test_frames_that_break_a_manager_op_are_refused_counted_and_answered(live, ops):
    link = live.link(SERVER_PARTY + 5)
    before = _rejected(live)
    link.request("lookup")  # a session
    for op in ops:
        field, value = _BAD.get(op, (None, None))
        meta = {"push": {"clock": 0, "version": 0}, "ring": {"version": 1}}.get(op, {})
        if op == "hello":  # refused before any session: answered in a frame signed like it
            field, meta = "keys", {"keys": 5, "policy": ""}
        elif field:
            meta = {"ring": -1} if op == "lookup" else {"server": 0, "ring": -1, "version": 0,
                                                        "pushes": 0, "address": "a",
                                                        "fingerprint": "fp", "expected": 2,
                                                        "attempt": 0, "shard": []}
            meta = {k: v for k, v in meta.items() if k in _fields(op)}
            meta[field] = value
        link.link.send(Message(op, meta))
        reply = _next(link)
        reason = f"schema:{op}.{field if field != 'extra' else 'unknown-field'}" if field \
            else f"schema:{op}"
        assert reply.op == "error" and reason in reply.meta["message"], reply
        if op == "hello":
            link.request("lookup")  # a new session (the refused hello ended the old one)
    after = _rejected(live)
    assert sum(after.values()) - sum(before.values()) == len(ops)
    assert link.request("lookup").op == "ring"  # still serving this party


def _fields(op: str) -> set:
    from disttrain.ps.schema import SCHEMA
    return set(SCHEMA[op].meta)


def _next(link: ManagerLink) -> Message:
    end = time.monotonic() + 5
    while link.link.sock.poll(max(1, int((end - time.monotonic()) * 1000))):
        msg = link.link.recv()
        if msg is not None:
            return msg
    raise AssertionError("no answer")


def _rejected(live: Live) -> dict:
    """The manager's counts of refused frames, by reason (its status answer)."""
    return live.link(1 << 30).request("status").meta["rejected"]


# ---- restart ----------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_a_manager_killed_with_sigkill_and_started_again_keeps_its_ring(tmp_path):
    state = str(tmp_path / "manager.json")
    first = manager.start(state, timeout=30.0, secret=KEY)
    try:
        servers = [ManagerLink(first.address, SERVER_PARTY + i, timeout=10, secret=KEY)
                   for i in (0, 1)]
        for i, link in enumerate(servers):
            _register(link, i, SHARD0 if i == 0 else SHARD1)
        beat = Heartbeat(servers[0], 0, lambda: (11, 44), interval=0.1)
        beat.start()
        worker = ManagerLink(first.address, 0, timeout=10, secret=KEY)
        assert worker.request("lookup").meta["version"] == 2
        os.kill(first.pid, signal.SIGKILL)
        first.process.join(5)
        second = manager.start(state, timeout=30.0, secret=KEY)
    finally:
        first.stop()
    try:
        assert second.address == first.address
        ring = worker.request("lookup").meta  # the same link: it says hello again by itself
        assert ring["version"] == 2 and ring["stale"] == 0 and ring["complete"] == 1
        assert [r["address"] for r in ring["servers"]] == ["ipc://s0", "ipc://s1"]
        time.sleep(0.4)  # server 0's heartbeat thread reconnects too
        state_now = worker.request("status").meta
        assert state_now["servers"][0]["version"] == 11 and state_now["servers"][0]["pushes"] == 44
        assert state_now["shard"][0] == {"key": "a", "bytes": 400, "chain": [0], "server": 0}
        beat.stop()
    finally:
        second.stop()


# ---- the command line -------------------------------------------------------------------
@pytest.fixture
def secret_env(monkeypatch):
    monkeypatch.setenv("DISTTRAIN_SECRET", KEY.hex())
    ds.refresh()
    yield
    monkeypatch.undo()
    ds.refresh()


@pytest.mark.timeout(30)
def test_a_worker_attaching_during_a_drain_gets_every_address_at_once(live, secret_env):
    """A slow worker looks the servers up after a drain began (and after it ended): the
    drained server is still one to attach to (it serves until its hand-over, then answers
    `moved`, and the worker re-routes). It used to wait for it to be alive again, for ever,
    while under Sync the drain waited for that worker's push, until the servers lost it."""
    s0, s1 = live.link(SERVER_PARTY), live.link(SERVER_PARTY + 1)
    _register(s0, 0, SHARD0)
    _register(s1, 1, SHARD1)
    drainer = live.link(0)
    drainer.request("lookup")
    assert drainer.request("leave", server=0).meta["servers"][0]["state"] == "leaving"
    assert lookup_addresses(live.address, 1, 2, timeout=2.0) == (3, ["ipc://s0", "ipc://s1"])
    s0.request("report", server=0, version=5, pushes=10, final=0, accepting=-1, drained=1)
    assert drainer.request("lookup").meta["servers"][0]["state"] == "left"
    assert lookup_addresses(live.address, 1, 2, timeout=2.0)[1] == ["ipc://s0", "ipc://s1"]
    with pytest.raises(ManagerError, match=r"servers 2 \(not registered\)"):
        lookup_addresses(live.address, 1, 3, timeout=0.3)  # one never registered: still waits


@pytest.mark.timeout(30)
def test_disttrain_ps_status_and_drain_through_the_command_line(live, secret_env, capsys,
                                                                tmp_path):
    _register(live.link(SERVER_PARTY), 0, SHARD0, expected=1)
    assert cli.main(["ps", "status", live.address]) == 0
    out = capsys.readouterr().out
    assert "ring version 1: 1 of 1 servers alive" in out and "server 0  chain 0" in out
    assert cli.main(["ps", "status", str(tmp_path / "manager.json")]) == 0  # the state file
    assert "ring version 1" in capsys.readouterr().out
    assert cli.main(["ps", "drain", live.address, "--server", "0"]) == 1
    assert "last live copy of 2 keys" in capsys.readouterr().err
    ds.refresh({"DISTTRAIN_SECRET": bytes(32).hex()})  # another job's secret
    assert cli.main(["ps", "status", live.address, "--timeout", "0.5"]) == 1
    assert "another DISTTRAIN_SECRET" in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_disttrain_ps_drain_of_a_server_holding_keys_says_they_move_first(live, secret_env,
                                                                          capsys):
    _register(live.link(SERVER_PARTY), 0, SHARD0)
    _register(live.link(SERVER_PARTY + 1), 1, SHARD1)
    assert cli.main(["ps", "drain", live.address, "--server", "1"]) == 0
    out = capsys.readouterr().out
    assert "server 1 is leaving: ring version 3; its keys move to the other servers" in out
    assert cli.main(["ps", "status", live.address]) == 0
    out = capsys.readouterr().out
    assert "ring version 3: 1 of 2 servers alive" in out and "leaving" in out
    assert "server 1 at ipc://s1 is leaving: its 1 keys move to the placement without it" in out
    assert cli.main(["ps", "drain", live.address, "--server", "0"]) == 1  # the only one left
    assert "no other server is alive to take them" in capsys.readouterr().err
