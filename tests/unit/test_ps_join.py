"""A server that joins a running job (ps/join_moves.py, ps/joiner.py, the manager's part in
ps/membership.py): where its keys come from (pure, the same on every rank), the ring
states it goes through, and every join the manager refuses, each naming the fix."""

import pytest

from disttrain import cli, settings
from disttrain.ps.join_moves import joined_owners, joiner
from disttrain.ps.joiner import JOIN_ENV, joining
from disttrain.ps.membership import Membership, Refused
from disttrain.ps.placement import place, plan_keys
from tests.unit.test_ps_manager import KEY, Live

MLP = [("0.weight", 64 * 64, 4), ("0.bias", 64, 4), ("2.weight", 64 * 10, 4), ("2.bias", 10, 4)]
MIXED = [("emb", 50_000 * 16, 4), ("big", 300_000, 4)] + [(f"n{i}", 97 + i, 4) for i in range(40)]


@pytest.mark.parametrize("params", [MLP, MIXED], ids=["mlp", "few-large-many-small"])
@pytest.mark.parametrize("servers", [2, 3, 4, 7, 15])
def test_a_joiner_takes_only_the_keys_the_placement_with_it_gives_it(params, servers):
    plan = plan_keys(params, servers)
    after = place(params, [f"server{i}" for i in range(servers + 1)])
    sizes, total, moved = after.sizes, sum(after.sizes.values()), 0
    for x in range(servers):
        keys = [c.key for c in plan[x]]
        owners = joined_owners(params, servers, servers, x, keys, 4 << 20)
        assert list(owners) == keys  # in the plan's order (a route's hello names them so)
        assert set(owners.values()) <= {x, servers} and x in owners.values()
        for k, o in owners.items():  # no cascade: a key moves only to the joiner, and only
            assert o == x or after.owner(k) == f"server{servers}"  # where the placement says
        forced = [k for k, o in owners.items() if o == x and after.owner(k) == f"server{servers}"]
        assert forced in ([], keys[:1])  # an old owner keeps its first key if it would keep none
        moved += sum(sizes[k] for k, o in owners.items() if o == servers)
    assert 0 < moved <= 2 * total / (servers + 1)  # about 1/(S+1), never past 2/(S+1)


def test_the_joiner_is_the_member_beyond_the_servers_launched():
    ring = {"expected": 2, "servers": [{"server": i, "state": "alive"} for i in range(2)]}
    assert joiner(ring) is None
    ring["servers"].append({"server": 2, "state": "joining"})
    assert joiner(ring) == 2


def _two() -> Membership:
    m = Membership()
    m.register(0, "ipc://s0", "fp", 2, [["a", 400, [0]]], 0.0)
    m.register(1, "ipc://s1", "fp", 2, [["b", 300, [1]]], 0.0)
    return m


def test_a_join_is_joining_until_its_first_route_serves_then_alive():
    m = _two()
    assert m.join(2, "ipc://s2", "fp", ring=2, now=1.0) and m.version == 3
    assert m.members[2].state == "joining"
    assert "server 2 joined at ipc://s2: the keys the placement on 3 servers gives it move " \
           "to it (joining)" in m.events[-1]
    assert not m.beat(2, 0, 0, False, 1.5, accepting=2)  # ready: every giver's link admitted
    assert m.accepting() == [[2, 2]] and m.version == 3
    own = {"server": 0, "by": 0, "address": "ipc://r00", "keys": 3, "bytes": 30, "version": 4,
           "after": 0.0}
    assert m.adopt(0, [own], 2.0) and m.version == 4  # server 0's kept keys, on a new address
    assert "server 0 took over 3 keys (0.00 MB) of alive server 0 at version 4 (a join moved " \
           "keys)" in m.events[-1]
    assert m.adopt(2, [dict(own, by=2, address="ipc://r02")], 2.5)
    assert m.members[2].state == "alive" and m.version == 5
    assert len(m.takeovers) == 2 and not m.adopt(2, [dict(own, by=2, address="ipc://r02")], 3)
    m.expire(20.0, 10.0)  # a joiner falls silent like any server
    assert m.members[2].state == "dead"


def test_joins_are_refused_with_the_reason_and_the_fix():
    one = Membership()
    one.register(0, "ipc://s0", "fp", 1, [["a", 400, [0]]], 0.0)
    with pytest.raises(Refused, match="server 1 cannot join: this job has one server.*"
                                      "--servers 2 or more"):
        one.join(1, "ipc://s1", "fp", ring=1, now=0.0)
    chains = Membership()
    chains.register(0, "ipc://s0", "fp", 2, [["a", 400, [0, 1]]], 0.0)
    chains.register(1, "ipc://s1", "fp", 2, [["a", 400, [0, 1]]], 0.0)
    assert chains.join(2, "ipc://s2", "fp", ring=2, now=0.0)  # NOTE: replicas >= 2 joins too
    m = _two()
    with pytest.raises(Refused, match="another model or policy"):
        m.join(2, "ipc://s2", "other", ring=2, now=0.0)
    with pytest.raises(Refused, match="already a member.*e.g. 2"):
        m.join(1, "ipc://s2", "fp", ring=2, now=0.0)
    assert m.join(2, "ipc://s2", "fp", ring=2, now=0.0)
    with pytest.raises(Refused, match="server 2 is joining: one membership change that moves "
                                      "keys per job"):
        m.join(3, "ipc://s3", "fp", ring=3, now=0.0)
    with pytest.raises(Refused, match="server 2 joined this job and took keys"):
        m.leave(0, ring=3)
    with pytest.raises(Refused, match="server 2 joined this job"):
        m.leave(2, ring=3)
    drained = _two()
    assert drained.leave(0, ring=2) and drained.members[0].state == "leaving"
    with pytest.raises(Refused, match="server 0 is leaving: one membership change"):
        drained.join(2, "ipc://s2", "fp", ring=3, now=0.0)
    assert m.version == 3 and drained.version == 3  # nothing refused changed anything


def test_add_server_needs_the_workers_the_script_and_the_jobs_secret(monkeypatch, capsys):
    monkeypatch.setenv("DISTTRAIN_SECRET", "00" * 32)
    assert cli.main(["ps", "add-server", "ipc://nowhere", "--workers", "2"]) == 2
    assert "usage: disttrain ps add-server ADDR --workers W -- script.py" in capsys.readouterr().err
    monkeypatch.delenv("DISTTRAIN_SECRET")
    settings.refresh()  # NOTE: the test changed the environment after the settings were read
    assert cli.main(["ps", "add-server", "ipc://nowhere", "--workers", "2", "--", "x.py"]) == 2
    assert "DISTTRAIN_SECRET is not set" in capsys.readouterr().err


def test_joining_reads_the_workers_add_server_sets(monkeypatch):
    monkeypatch.delenv(JOIN_ENV, raising=False)
    settings.refresh()
    assert joining() == 0
    monkeypatch.setenv(JOIN_ENV, "3")
    settings.refresh()
    assert joining() == 3
    monkeypatch.setenv(JOIN_ENV, "yes")
    with pytest.raises(settings.SettingsError, match="DISTTRAIN_PS_JOIN"):
        settings.refresh()


@pytest.fixture
def live(tmp_path, monkeypatch):
    """A manager on the job's wire (test_ps_manager.Live), and the job's secret exported."""
    from disttrain import settings

    monkeypatch.setenv("DISTTRAIN_SECRET", KEY.hex())
    settings.refresh()
    m = Live(str(tmp_path / "manager.json"))
    yield m
    m.close()
    monkeypatch.undo()
    settings.refresh()


@pytest.mark.timeout(60)
def test_ps_join_is_refused_by_a_live_manager_naming_the_fix(live):
    import torch

    from disttrain import ps
    from disttrain.ps.manager_link import SERVER_PARTY, ManagerError, fingerprint

    model = torch.nn.Linear(8, 4)
    spec = [(n, p.numel(), p.element_size()) for n, p in model.named_parameters()]
    live.link(SERVER_PARTY).request(
        "register", server=0, address="ipc://s0", expected=1, attempt=0, shard=[],
        fingerprint=fingerprint(spec, repr(ps.Sync()), 4 << 20))
    with pytest.raises(ManagerError, match="server 1 serves another model or policy.*same "
                                           "model and policy"):
        ps.join(torch.nn.Linear(8, 5), workers=1, manager=live.address, timeout=5)
    with pytest.raises(ManagerError, match="server 1 cannot join: this job has one server"):
        ps.join(model, workers=1, manager=live.address, timeout=5)
