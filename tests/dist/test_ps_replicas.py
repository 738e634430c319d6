"""Replicated key ranges (replicas=r) on real processes: 2 workers, 3 servers.

Every key lives on its head and the next r-1 servers of the ring; the head chain-
replicates each applied update (after aggregation) and acknowledges a push only once
every copy has it. Checked: after the job every copy's parameters AND optimizer state
are bitwise the head's (Sync with SGD momentum, Async with Adam, so the lr factor of a
stale gradient travels too), the copies' versions are the head's, Sync's final
parameters are bitwise those of an r = 1 run of the same job (and close to single-process
SGD), and each server's report names its role per key range.
"""

import secrets

import pytest
import torch
import torch.distributed as dist

import disttrain
from disttrain import ps
from disttrain.ps.connect import format_stats
from disttrain.ps.replica import Replicas
from disttrain.ps.placement import plan_keys
from disttrain.ps.server import Server
from disttrain.ps.transport import job_secret
from disttrain.testing import spawn

W, S, B, STEPS = 2, 3, 4, 4
ENV = {"DISTTRAIN_SERVERS": str(S), "DISTTRAIN_SECRET": secrets.token_hex(32)}
JOBS = [("sync", 1), ("sync", 2), ("sync", 3), ("async", 2), ("async", 3)]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _policy(mode):
    return ps.Sync() if mode == "sync" else ps.Async()


def _opt(mode):
    if mode == "sync":
        return lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)
    return lambda p: torch.optim.Adam(p, lr=0.01)


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, W * B, 8, generator=g), torch.randn(STEPS, W * B, 3, generator=g)


def _state(params: dict, optimizer) -> dict:
    """key -> [value, *optimizer state tensors] (cloned)."""
    out = {}
    for k, p in params.items():
        st = optimizer.state.get(p, {}) if optimizer is not None else {}
        out[k] = [p.detach().clone()] + [torch.as_tensor(st[n]).clone() for n in sorted(st)]
    return out


def _serve(mode, r, name):
    """What ps.serve does, keeping the Server so the test can read its shard and copies."""
    model, workers = _model(), list(range(W))
    plan = plan_keys([(n, p.numel(), p.element_size()) for n, p in model.named_parameters()],
                     S, chunk_bytes=64)
    index = disttrain.rank() - W
    server = Server(index, plan[index], dict(model.named_parameters()), _policy(mode),
                    _opt(mode), workers, job_secret(), timeout=20, chunk_bytes=64)
    store = dist.distributed_c10d._get_default_store()
    store.set(f"disttrain/{name}/addr{index}", server.address)
    if r > 1:
        server.chain = Replicas(index, W, plan, r, dict(model.named_parameters()), _opt(mode),
                                server.policy, server.ep, job_secret(), timeout=20,
                                chunk_bytes=64)
        server.chain.connect({j: store.get(f"disttrain/{name}/addr{j}").decode()
                              for j in range(S) if j != index})
    stats = server.serve()
    copies = _state(server.chain.params, server.chain.optimizer) if r > 1 else {}
    return {"role": "server", "stats": stats, "own": _state(server.params, server.optimizer),
            "copies": copies, "line": format_stats(stats)}


def _train(conn, model, xs, ys) -> list[torch.Tensor]:
    """Pull, step on this worker's slice of batch t, push, for every t of `xs`; then a last
    pull; closes `conn`; blocks on every pull and push. The final parameters (cloned)."""
    i = disttrain.rank()
    for t in range(len(xs)):
        conn.pull().wait()
        model.zero_grad()
        x, y = xs[t, i * B:(i + 1) * B], ys[t, i * B:(i + 1) * B]
        torch.nn.functional.mse_loss(model(x), y).backward()
        conn.push().wait()
    conn.pull().wait()
    conn.close()
    return [p.detach().clone() for p in model.parameters()]


def _work(mode, r, name):
    model = _model()
    conn = ps.attach(model, _policy(mode), chunk_bytes=64, timeout=20, name=name, replicas=r)
    return {"role": "worker", "params": _train(conn, model, *_data())}


def run_all():
    out = {}
    for mode, r in JOBS:
        name = f"{mode}{r}"
        out[name] = _serve(mode, r, name) if disttrain.role() == "server" else _work(mode, r, name)
    # replicas larger than the number of servers: refused on every rank, naming both
    try:
        if disttrain.role() == "server":
            ps.serve(_model(), ps.Sync(), replicas=S + 1, name="too-many")
        else:
            ps.attach(_model(), ps.Sync(), replicas=S + 1, name="too-many")
    except ValueError as e:
        out["refused"] = str(e)
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(run_all, W + S, env=ENV, timeout=240)


def _reference():
    model, (xs, ys) = _model(), _data()
    opt = _opt("sync")(model.parameters())
    for t in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xs[t]), ys[t]).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,r", JOBS[1:])
def test_every_copy_is_the_heads_bitwise(results, mode, r):
    servers = [results[W + i][f"{mode}{r}"] for i in range(S)]
    heads = {k: v for s in servers for k, v in s["own"].items()}
    copies = 0
    for i, s in enumerate(servers):
        for k, got in s["copies"].items():
            want = heads[k]
            assert len(got) == len(want) > 1, k  # parameter and its optimizer state
            for g, w in zip(got, want):
                assert torch.equal(g, w), (k, i)
            copies += 1
    assert copies == (r - 1) * len(heads)
    versions = {s["stats"]["server"]: s["stats"]["version"] for s in servers}
    for s in servers:
        for origin, v in s["stats"]["replica_versions"].items():
            assert v == versions[int(origin)]
        roles = {x["role"] for x in s["stats"]["ranges"]}
        assert roles == ({"head", "tail"} if r == 2 else {"head", "middle", "tail"})
        assert s["stats"]["replicate_frames"] > 0 and f"replicas {r}: head of" in s["line"]
    assert sum(s["stats"]["applied"] for s in servers) == S * W * STEPS


@pytest.mark.timeout(300)
@pytest.mark.parametrize("r", [2, 3])
def test_sync_replicated_equals_unreplicated_bitwise(results, r):
    ref = _reference()
    for w in range(W):
        base, got = results[w]["sync1"]["params"], results[w][f"sync{r}"]["params"]
        for a, b, c in zip(base, got, ref):
            assert torch.equal(a, b)
            torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(300)
def test_more_replicas_than_servers_is_refused_on_every_rank(results):
    for r in results:
        assert "replicas=4 needs at least 4 servers, the job has 3" in r["refused"]
    assert "replicas" not in results[W]["sync1"]["stats"]  # r = 1: no replication at all
