"""Parameter server vs a single-process reference, on real processes and sockets.

Sync with server-side SGD (momentum) must equal single-process SGD on the same global
batches; KSync(P) must equal Sync; parameters are chunked over two servers. The wire is
encrypted here (DISTTRAIN_PS_ENCRYPT=1; the other dist tests use the default, MAC only).
A third Sync job has worker 0 close straight after its last push (no final pull) while
worker 1, an injected straggler, still computes: the last round must wait for worker 1's
push and apply both, cancelling nobody.
"""

import secrets
import time

import pytest
import torch

import disttrain
from disttrain import ps
from disttrain.ps.straggler import Straggler
from disttrain.testing import spawn

W, B, STEPS = 2, 4, 4
ENV = {"DISTTRAIN_SERVERS": "2", "DISTTRAIN_SECRET": secrets.token_hex(32),
       "DISTTRAIN_PS_ENCRYPT": "1"}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, W * B, 8, generator=g), torch.randn(STEPS, W * B, 3, generator=g)


def _opt(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def train_both():
    # NOTE: both jobs in one set of processes (startup dominates on 2 shared cores)
    return {name: _train(name) for name in ("sync", "ksync", "leave")}


def _train(policy_name):
    model = _model()
    policy = {"sync": ps.Sync(), "ksync": ps.KSync(W), "leave": ps.Sync()}[policy_name]
    slow, cancelled = Straggler.parse("fixed:rank=1,delay=0.4"), 0
    # chunk_bytes=64 cuts every weight into 16-float keys spread over both servers
    if disttrain.role() == "server":
        return {"role": "server", "stats": ps.serve(model, policy, _opt, chunk_bytes=64,
                                                    timeout=20, name=policy_name)}
    conn = ps.attach(model, policy, chunk_bytes=64, timeout=20, name=policy_name)
    xs, ys = _data()
    r = disttrain.rank()
    for t in range(STEPS):
        conn.pull().wait()
        model.zero_grad()
        if policy_name == "leave" and t == STEPS - 1:
            time.sleep(slow.delay(r, t))  # NOTE: before backward: pushes leave from its hooks
        x, y = xs[t, r * B:(r + 1) * B], ys[t, r * B:(r + 1) * B]
        try:
            torch.nn.functional.mse_loss(model(x), y).backward()
            conn.push().wait()
        except ps.Cancelled:
            cancelled += 1
    if policy_name != "leave" or r != 0:  # "leave": worker 0 closes right after its push
        conn.pull().wait()
    encrypted = all(link.session.flags == 1 for link in conn._eps)
    stats = conn.close()
    return {"role": "worker", "params": [p.detach().clone() for p in model.parameters()],
            "stats": stats, "encrypted": encrypted, "cancelled": cancelled}


def _reference():
    model, (xs, ys) = _model(), _data()
    opt = _opt(model.parameters())
    for t in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xs[t]), ys[t]).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.fixture(scope="module")
def results():
    return spawn(train_both, W + 2, env=ENV, timeout=50)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy_name", ["sync", "ksync", "leave"])
def test_sync_and_ksync_all_equal_single_process_sgd(results, policy_name):
    out = [r[policy_name] for r in results]
    ref = _reference()
    for r in range(W):
        assert out[r]["role"] == "worker" and out[r]["encrypted"]
        assert out[r]["cancelled"] == 0, (r, out[W:])
        if policy_name == "leave" and r == 0:
            continue  # closed before the last round was applied: nothing to compare
        for got, want in zip(out[r]["params"], ref):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    servers = [o["stats"] for o in out[W:]]
    assert all(s["version"] == STEPS and s["dropped"] == 0 for s in servers), servers
    assert all(s["applied"] == W * STEPS for s in servers), servers
    assert all(s["staleness"] == {0: W * STEPS} for s in servers)
    # the parameters really were spread: both servers applied updates to their keys
    assert {s["server"] for s in servers} == {0, 1}
    assert all(s["rejected_frames"] == 0 for s in servers)
