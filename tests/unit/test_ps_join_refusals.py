"""Every join the manager or `ps.join` refuses (ps/membership.py `Membership.join`,
`_joinable`, `leave`; ps/joiner.py `join`), one test per reason: each message names the
reason and the fix, and a refused change changes nothing. Also what `disttrain ps
add-server` says when the joiner's process is killed by a signal."""

import signal

import pytest

from disttrain import cli, settings
from disttrain.ps.manager_link import SERVER_PARTY, ManagerError, fingerprint
from disttrain.ps.membership import LEAVING, Membership, Refused
from tests.unit.test_ps_manager import KEY, Live

SPEC = [("0.weight", 32, 4), ("0.bias", 4, 4)]
FP = fingerprint(SPEC, "Sync()", 4 << 20)


def _two(chain=(0,), other=(1,)) -> Membership:
    """A job of two servers, one key each (chains as given: replicas=1 by default)."""
    m = Membership()
    m.register(0, "ipc://s0", FP, 2, [["a", 400, list(chain)]], 0.0)
    m.register(1, "ipc://s1", FP, 2, [["b", 300, list(other)]], 0.0)
    return m


def _refused(m: Membership, match: str, server: int = 2) -> None:
    version, states = m.version, {i: x.state for i, x in m.members.items()}
    with pytest.raises(Refused, match=match):
        m.join(server, f"ipc://s{server}", FP, ring=m.version, now=1.0)
    assert m.version == version and {i: x.state for i, x in m.members.items()} == states


@pytest.mark.parametrize("other", [fingerprint([("0.weight", 33, 4), ("0.bias", 4, 4)],
                                               "Sync()", 4 << 20),
                                   fingerprint(SPEC, "Async()", 4 << 20),
                                   fingerprint(SPEC, "Sync()", 1 << 20)],
                         ids=["model", "policy", "chunk-size"])
def test_a_joiner_of_another_model_policy_or_chunk_size_is_refused(other):
    m = _two()
    with pytest.raises(Refused, match="server 2 serves another model or policy .*: build the "
                                      "same model and policy on every rank"):
        m.join(2, "ipc://s2", other, ring=m.version, now=1.0)
    assert 2 not in m.members


def test_a_join_to_a_job_of_one_server_is_refused():
    m = Membership()
    m.register(0, "ipc://s0", FP, 1, [["a", 400, [0]]], 0.0)
    _refused(m, "server 1 cannot join: this job has one server, whose keys are whole tensors"
                r".*start it with --servers 2 or more", server=1)


def test_a_join_while_a_drain_is_under_way_is_refused():
    m = _two()
    assert m.leave(0, ring=m.version) and m.members[0].state == LEAVING
    _refused(m, "server 2 cannot join: server 0 is leaving: one membership change that moves "
                r"keys per job \(a join or a drain\); restart the job with the servers it needs")


def test_a_join_after_a_drain_moved_keys_is_refused():
    m = _two()
    m.leave(0, ring=m.version)
    assert m.beat(0, m.version, 0, False, 1.0, drained=True)  # its keys moved: LEFT
    _refused(m, "server 2 cannot join: server 0 is left: one membership change that moves keys")


def test_a_join_while_another_join_is_under_way_is_refused():
    m = _two()
    assert m.join(2, "ipc://s2", FP, ring=m.version, now=1.0)
    _refused(m, "server 3 cannot join: server 2 is joining: one membership change that moves "
                "keys per job", server=3)


def test_a_join_after_another_join_moved_keys_is_refused():
    m = _two()
    m.join(2, "ipc://s2", FP, ring=m.version, now=1.0)
    own = {"server": 2, "by": 2, "address": "ipc://r02", "keys": 1, "bytes": 4, "version": 0,
           "after": 0.0}
    assert m.adopt(2, [own], 2.0) and m.members[2].state == "alive"
    _refused(m, "server 3 cannot join: server 2 is alive: one membership change", server=3)


def test_a_join_after_a_death_is_refused():
    m = _two(chain=(0, 1), other=(1, 0))
    m.members[1].beat = 100.0  # NOTE: server 1 beat on: only 0 is marked dead
    assert m.expire(now=100.0, timeout=5.0)
    assert [x.state for _, x in sorted(m.members.items())] == ["dead", "alive"]
    _refused(m, "server 2 cannot join: server 0 is dead: a join after a death is not built "
                r"\(the join's moves follow the launch plan's chains, a takeover changed them\); "
                "restart the job with the servers it needs")


@pytest.mark.parametrize("server", [0, 2], ids=["an-old-owner", "the-joiner"])
def test_a_drain_after_a_join_is_refused(server):
    m = _two()
    m.join(2, "ipc://s2", FP, ring=m.version, now=1.0)
    with pytest.raises(Refused, match="server 2 joined this job and took keys: one membership "
                                      "change that moves keys per job; restart the job to "
                                      "drain one"):
        m.leave(server, ring=m.version)
    assert m.members[0].state == "alive"


@pytest.mark.parametrize("server", [0, 1, -1], ids=["launched-0", "launched-1", "manager"])
def test_a_join_at_an_index_in_use_is_refused_naming_a_free_one(server):
    _refused(_two(), "already a member of ring version 2: pick an index not in use, e.g. 2",
             server=server)


def test_a_join_on_an_old_ring_version_is_refused():
    m = _two()
    with pytest.raises(ValueError, match="ring version"):
        m.join(2, "ipc://s2", FP, ring=m.version - 1, now=1.0)
    assert 2 not in m.members


def test_ps_join_without_a_manager_names_the_variable(monkeypatch):
    import torch

    from disttrain import ps

    monkeypatch.delenv(settings.PS_MANAGER, raising=False)
    settings.refresh()
    with pytest.raises(ValueError, match="ps.join: no server manager: pass manager=ADDR .*"
                                         "DISTTRAIN_PS_MANAGER"):
        ps.join(torch.nn.Linear(8, 4), workers=1)


def test_a_joiner_started_with_snapshots_is_refused_naming_the_fix(monkeypatch):
    """ps.connect passes the job's snapshot= to ps.join, which refuses it before it asks
    the manager: a restart after the join would restore the owners' hand-over snapshots."""
    import torch

    from disttrain import ps

    monkeypatch.setenv(settings.PS_JOIN, "2")
    monkeypatch.setenv(settings.PS_MANAGER, "ipc:///nonexistent/manager")
    settings.refresh()
    try:
        with pytest.raises(ValueError, match=r"ps.join with snapshot='ckpt/ps\{server\}"
                                             r".safetensors': a joined server keeps no "
                                             r"snapshot.* join a job without snapshot="):
            ps.connect(torch.nn.Linear(8, 4), snapshot="ckpt/ps{server}.safetensors",
                       snapshot_every=2)
    finally:
        monkeypatch.undo()
        settings.refresh()


@pytest.fixture
def live(tmp_path, monkeypatch):
    """A manager of a job of two servers (Sync, nn.Linear(8, 4)), the job's secret exported."""
    import torch

    from disttrain import ps

    monkeypatch.setenv("DISTTRAIN_SECRET", KEY.hex())
    settings.refresh()
    m = Live(str(tmp_path / "manager.json"))
    spec = [(n, p.numel(), p.element_size()) for n, p in torch.nn.Linear(8, 4).named_parameters()]
    link = m.link(SERVER_PARTY)
    for i in range(2):
        link.request("register", server=i, address=f"ipc://s{i}", expected=2, attempt=0,
                     shard=[], fingerprint=fingerprint(spec, repr(ps.Sync()), 4 << 20))
    link.close()
    yield m
    m.close()
    monkeypatch.undo()
    settings.refresh()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("change", ["policy", "chunk-size"])
def test_ps_join_of_another_policy_or_chunk_size_is_refused_by_the_manager(live, change):
    import torch

    from disttrain import ps

    kw = dict(policy=ps.Async()) if change == "policy" else dict(chunk_bytes=1 << 20)
    with pytest.raises(ManagerError, match="server 2 serves another model or policy.*same "
                                           "model and policy"):
        ps.join(torch.nn.Linear(8, 4), workers=1, manager=live.address, timeout=5, **kw)


@pytest.mark.timeout(60)
def test_add_server_names_the_server_and_the_signal_that_killed_the_joiner(live, tmp_path,
                                                                           capsys):
    script = tmp_path / "joiner.py"
    script.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    code = cli.main(["ps", "add-server", live.address, "--workers", "2", "--", str(script)])
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGKILL, err
    assert f"server 2 (the joining server's process, {script}) was killed by SIGKILL: exit " \
           "137" in err, err


@pytest.mark.timeout(60)
def test_add_server_passes_on_the_joiners_own_exit_code(live, tmp_path, capsys):
    script = tmp_path / "joiner.py"
    script.write_text(f"import os, sys\nsys.exit(3 if os.environ['{settings.PS_JOIN}'] == '2' "
                      f"and os.environ['{settings.PS_MANAGER}'] == {live.address!r} else 4)\n")
    assert cli.main(["ps", "add-server", live.address, "--workers", "2", "--", str(script)]) == 3
    assert "killed" not in capsys.readouterr().err


@pytest.mark.slow  # NOTE: about 6 s under load (the joiner's process imports torch)
@pytest.mark.timeout(60)
def test_add_server_of_another_model_ends_with_the_managers_refusal(live, tmp_path, capfd):
    script = tmp_path / "joiner.py"
    script.write_text("import torch\nfrom disttrain import ps\n"
                      "ps.join(torch.nn.Linear(8, 5), workers=2)\n")
    assert cli.main(["ps", "add-server", live.address, "--workers", "2", "--", str(script)]) == 1
    err = capfd.readouterr().err
    assert "ManagerError: server manager refused join: server 2 serves another model or " \
           "policy" in err, err
    assert "build the same model and policy on every rank" in err, err
