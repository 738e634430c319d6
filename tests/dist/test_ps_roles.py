"""`ps.serve` and `ps.attach`, each role's own entry point, against `ps.connect`.

One set of real processes (2 workers, 1 server) runs the same Sync job three times:
through `serve`/`attach` called directly, again with the addresses from a server manager
(a real manager process) instead of the store, then through `connect`. Each entry point returns its
one type, the parameters of both jobs are bitwise equal, `connect` ends the server's
part with SystemExit(0) after serving, and each entry point on the wrong rank is refused
with an error naming the right one.
"""

import json
import os
import secrets

import pytest
import torch

import disttrain
from disttrain import ps
from disttrain.ps import manager
from disttrain.testing import spawn

W, B, STEPS = 2, 4, 3
ENV = {"DISTTRAIN_SERVERS": "1", "DISTTRAIN_SECRET": secrets.token_hex(32)}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _opt(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _train(conn, model):
    g = torch.Generator().manual_seed(1 + disttrain.rank())
    for _ in range(STEPS):
        conn.pull().wait()
        model.zero_grad()
        x, y = torch.randn(B, 6, generator=g), torch.randn(B, 2, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        conn.push().wait()
    conn.pull().wait()
    conn.close()
    return [p.detach().clone() for p in model.parameters()]


def _misuse(model):
    """The other role's entry point on this rank: the error it raises."""
    call = ps.attach if disttrain.role() == "server" else ps.serve
    try:
        call(model, ps.Sync())
    except RuntimeError as e:
        return str(e)
    return "no error"


def both_ways():
    out = {"role": disttrain.role(), "misuse": _misuse(_model())}
    try:
        ps.connect(_model(), ps.Sync(), _opt, snapshot_every_typo=1)
    except TypeError as e:
        out["typo"] = str(e)
    model = _model()
    if disttrain.role() == "server":
        out["served"] = ps.serve(model, ps.Sync(), _opt, timeout=20, name="roles")
        ps.serve(_model(), ps.Sync(), _opt, timeout=20, name="managed", manager=_MANAGER())
        try:
            ps.connect(_model(), ps.Sync(), _opt, timeout=20, name="connect")
        except SystemExit as e:  # what ends the server's script after connect
            out["exit"] = e.code
        return out
    conn = ps.attach(model, ps.Sync(), timeout=20, name="roles")
    out["attach_type"] = type(conn).__name__
    out["attach"] = _train(conn, model)
    model = _model()
    out["managed"] = _train(ps.attach(model, ps.Sync(), timeout=20, name="managed",
                                      manager=_MANAGER()), model)
    model = _model()
    conn = ps.connect(model, ps.Sync(), _opt, timeout=20, name="connect")
    out["connect_type"] = type(conn).__name__
    out["connect"] = _train(conn, model)
    return out


def _MANAGER() -> str:
    return os.environ["TEST_PS_MANAGER"]  # NOTE: explicit: the group is not named "ps"


@pytest.fixture(scope="module")
def manager_state(tmp_path_factory):
    state = str(tmp_path_factory.mktemp("manager") / "manager.json")
    running = manager.start(state, secret=bytes.fromhex(ENV["DISTTRAIN_SECRET"]))
    yield running, state
    running.stop()


@pytest.fixture(scope="module")
def results(manager_state):
    return spawn(both_ways, W + 1, env=dict(ENV, TEST_PS_MANAGER=manager_state[0].address),
                 timeout=90)


@pytest.mark.timeout(100)
def test_serve_and_attach_through_a_server_manager_train_bitwise_as_through_the_store(
        results, manager_state):
    for r in results[:W]:
        for a, m in zip(r["attach"], r["managed"], strict=True):
            assert torch.equal(a, m)
    with open(manager_state[1]) as f:
        state = json.load(f)
    assert state["version"] == 1 and state["address"] == manager_state[0].address
    (server,) = state["members"]
    assert server["state"] == "exited" and server["version"] == STEPS
    assert [(k, n, c) for k, n, c in server["shard"]] == [
        (name, p.numel() * 4, [0]) for name, p in _model().named_parameters()]


@pytest.mark.timeout(100)
def test_serve_and_attach_train_bitwise_as_connect(results):
    for r in results[:W]:
        assert r["attach_type"] == r["connect_type"] == "Worker"
        for a, c in zip(r["attach"], r["connect"], strict=True):
            assert torch.equal(a, c)
    assert all(torch.equal(a, b) for a, b in zip(results[0]["attach"], results[1]["attach"],
                                                 strict=True))
    assert not torch.equal(results[0]["attach"][0], _model()[0].weight.detach())


@pytest.mark.timeout(100)
def test_serve_returns_the_stats_and_connect_ends_the_server(results):
    server = results[W]
    assert server["role"] == "server"
    stats = server["served"]
    assert isinstance(stats, dict)
    assert stats["applied"] == W * STEPS and stats["version"] == STEPS
    assert server["exit"] == 0


@pytest.mark.timeout(100)
def test_wrong_rank_and_unknown_keyword_are_refused(results):
    assert "ps.attach on rank 2, which is a server" in results[W]["misuse"]
    assert "call ps.serve(...) on this rank" in results[W]["misuse"]
    for r, out in enumerate(results[:W]):
        assert f"ps.serve on rank {r}, which is a worker" in out["misuse"]
        assert "call ps.attach(...) on this rank" in out["misuse"]
    for out in results:
        assert "unknown keyword(s) ['snapshot_every_typo']" in out["typo"]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("call", ["serve", "attach", "connect"])
def test_outside_a_ps_job_every_entry_point_says_how_to_launch_one(call):
    with pytest.raises(RuntimeError, match=rf"ps\.{call}: a parameter-server job needs "
                       r"1 <= servers < world size.*disttrain run --workers W --servers S"):
        getattr(ps, call)(_model(), ps.Sync())


@pytest.mark.timeout(20)
def test_connect_exit_false_is_deprecated_in_favour_of_serve_and_attach():
    with pytest.warns(DeprecationWarning, match=r"call ps\.serve\(\.\.\.\) on server ranks"):
        with pytest.raises(RuntimeError, match="parameter-server job needs"):
            ps.connect(_model(), ps.Sync(), exit=False)
