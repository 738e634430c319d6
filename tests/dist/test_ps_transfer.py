"""Chain extension on real processes (ps/transfer.py): 2 workers, 3 servers.

While the workers train, the tail T of some keys' chains sends their state to server Y
and makes Y their new tail; training goes on. Checked after more steps: Y's copy of
every moved key (value, every optimizer tensor) is bitwise the head's, Y's version of
the head is the head's, each transfer moved exactly the keys asked for, and the job's
parameters are those of single-process SGD. Two jobs: Sync with SGD momentum at
replicas=2 (T is a copy, chain [X, T] becomes [X, T, Y]) and Async with Adam at
replicas=1 (T is the head itself, chain [X] becomes [X, Y]).

NOTE: slow (about 45 s on two loaded cores: two jobs of five processes); the fast tier
covers the new tail's side with tests/unit/test_ps_transfer.py (a live server installs a
transfer bitwise, steps the new copy as the head, refuses bad frames).
"""

import secrets
from collections import Counter

import pytest
import torch
import torch.distributed as dist

import disttrain
from disttrain import ps
from disttrain.ps import transfer
from disttrain.ps.placement import plan_keys
from disttrain.ps.replica import Replicas
from disttrain.ps.server import Server
from disttrain.ps.transport import job_secret
from disttrain.testing import spawn
from tests.dist.test_ps_replicas import (  # the same jobs
    _model,
    _opt,
    _policy,
    _state,
    _train,
)

W, S, B, STEPS, AT, CHUNK = 2, 3, 4, 8, 3, 64
ENV = {"DISTTRAIN_SERVERS": str(S), "DISTTRAIN_SECRET": secrets.token_hex(32)}
JOBS = [("sync", 2), ("async", 1)]


def _plan():
    model = _model()
    return plan_keys([(n, p.numel(), p.element_size()) for n, p in model.named_parameters()],
                     S, chunk_bytes=CHUNK)


def moves(r: int) -> tuple[list[str], int, int]:
    """(keys of server 0 that move, their tail T, the new tail Y): the same on every rank."""
    plan = _plan()
    if r == 1:
        return [c.key for c in plan[0]], 0, 1
    chains = {c.key: [int(s.removeprefix("server")) for s in plan.chain(c.key, r)]
              for c in plan[0]}
    tail = Counter(ch[-1] for ch in chains.values()).most_common(1)[0][0]
    return [k for k, ch in chains.items() if ch[-1] == tail], tail, ({0, 1, 2} - {0, tail}).pop()


def _serve(mode, r, name):
    model, plan, index = _model(), _plan(), disttrain.rank() - W
    init, secret = dict(model.named_parameters()), job_secret()
    server = Server(index, plan[index], init, _policy(mode), _opt(mode), list(range(W)),
                    secret, timeout=20, chunk_bytes=CHUNK)
    store = dist.distributed_c10d._get_default_store()
    store.set(f"disttrain/{name}/addr{index}", server.address)
    addresses = {j: store.get(f"disttrain/{name}/addr{j}").decode() for j in range(S)}
    if r > 1:
        server.chain = Replicas(index, W, plan, r, init, _opt(mode), server.policy, server.ep,
                                secret, timeout=20, chunk_bytes=CHUNK)
        server.chain.connect({j: a for j, a in addresses.items() if j != index})
    keys, tail, new = moves(r)
    kw = dict(replicas=r, secret=secret, chunk_bytes=CHUNK)
    ext = intake = None
    if index == tail:
        ext = transfer.extend(server, plan, init, _opt(mode), keys, new, addresses[new],
                              at_version=AT, **kw)
    elif index == new:
        intake = transfer.accept(server, plan, init, _opt(mode), tail, keys, **kw)
    stats = server.serve()
    copies = _state(server.chain.params, server.chain.optimizer) if server.chain else {}
    return {"stats": stats, "own": _state(server.params, server.optimizer), "copies": copies,
            "extension": ext and ext.stats, "intake": intake and intake.stats}


def _work(mode, r, name):
    model = _model()
    conn = ps.attach(model, _policy(mode), chunk_bytes=CHUNK, timeout=20, name=name,
                     replicas=r, manager="")
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(STEPS, W * B, 8, generator=g), torch.randn(STEPS, W * B, 3, generator=g)
    return {"params": _train(conn, model, xs, ys), "xs": xs, "ys": ys}


def run_all():
    out = {}
    for mode, r in JOBS:
        name = f"{mode}{r}"
        out[name] = _serve(mode, r, name) if disttrain.role() == "server" else _work(mode, r, name)
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(run_all, W + S, env=ENV, timeout=240)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,r", JOBS)
def test_the_new_tail_is_the_heads_copy_bitwise_after_more_steps(results, mode, r):
    keys, tail, new = moves(r)
    servers = [results[W + i][f"{mode}{r}"] for i in range(S)]
    head = servers[0]
    got = servers[new]
    assert set(keys) <= set(got["copies"])
    for k in keys:
        want, have = head["own"][k], got["copies"][k]
        assert len(want) == len(have) > 1, k  # the value and its optimizer state
        for a, b in zip(want, have):
            assert torch.equal(a, b), k
    assert got["stats"]["replica_versions"]["0"] == head["stats"]["version"] == (
        STEPS if mode == "sync" else W * STEPS)
    ext, intake = servers[tail]["extension"], got["intake"]
    assert ext["keys"] == intake["keys"] == len(keys) and ext["bytes"] == intake["bytes"]
    assert AT <= ext["version"] == intake["version"] < head["stats"]["version"]
    chains = {tuple(x["chain"]) for x in got["stats"]["ranges"]}
    assert any(c[0] == 0 and c[-1] == new and tail in c for c in chains), chains


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sync_with_an_extension_trains_as_single_process_sgd(results):
    model = _model()
    opt = _opt("sync")(model.parameters())
    xs, ys = results[0]["sync2"]["xs"], results[0]["sync2"]["ys"]
    for t in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xs[t]), ys[t]).backward()
        opt.step()
    for w in range(W):
        for a, b in zip(results[w]["sync2"]["params"], model.parameters()):
            torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
