"""A Sync worker that closes right after its last push (no final pull) while the others'
pushes for that round are still in flight: the round must wait for them and apply all.

3 workers, 1 server. Worker 0 ends its loop with a push and `close()`; worker 2 is an
injected straggler (ps/straggler.py), so worker 0's push and done reach the server before
worker 2's push. Every round, the last included, must average all three gradients in
worker order: the parameters pulled at the end equal a single-process reference bitwise,
nothing is cancelled or dropped, and the server applied 3 x STEPS pushes.
"""

import secrets
import time

import pytest
import torch

import disttrain
from disttrain import ps
from disttrain.ps.straggler import Straggler
from disttrain.testing import spawn

W, B, STEPS = 3, 4, 2
ENV = {"DISTTRAIN_SERVERS": "1", "DISTTRAIN_SECRET": secrets.token_hex(32)}
SLOW = Straggler.parse("fixed:rank=2,delay=0.4")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 11), torch.nn.Tanh(), torch.nn.Linear(11, 2))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, W * B, 6, generator=g), torch.randn(STEPS, W * B, 2, generator=g)


def _opt(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _job():
    model = _model()
    if disttrain.role() == "server":
        return ps.serve(model, ps.Sync(), _opt, timeout=20, name="leave")
    conn = ps.attach(model, ps.Sync(), timeout=20, name="leave")
    r, (xs, ys), cancelled = disttrain.rank(), _data(), 0
    for t in range(STEPS):
        conn.pull().wait()
        model.zero_grad()
        time.sleep(SLOW.delay(r, t))  # NOTE: before backward: pushes leave from its hooks
        try:
            x, y = xs[t, r * B:(r + 1) * B], ys[t, r * B:(r + 1) * B]
            torch.nn.functional.mse_loss(model(x), y).backward()
            conn.push().wait()
        except ps.Cancelled:
            cancelled += 1
    if r != 0:  # worker 0 closes straight after its last push
        conn.pull().wait()
    conn.close()
    return {"params": [p.detach().clone() for p in model.parameters()],
            "cancelled": cancelled}


def _reference():
    model, (xs, ys) = _model(), _data()
    opt = _opt(model.parameters())
    for t in range(STEPS):
        grads = []
        for r in range(W):
            model.zero_grad()
            x, y = xs[t, r * B:(r + 1) * B], ys[t, r * B:(r + 1) * B]
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.detach().clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            total = grads[0][i].clone()
            for g in grads[1:]:
                total.add_(g[i])
            p.grad = total.div_(W)
        opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.timeout(90)
def test_sync_round_waits_for_the_others_when_a_worker_closes_after_its_push():
    out = spawn(_job, W + 1, env=ENV, timeout=80)
    server = out[W]
    assert [out[r]["cancelled"] for r in range(W)] == [0] * W, server
    assert server["applied"] == W * STEPS and server["dropped"] == 0, server
    assert server["version"] == STEPS, server
    for r in (1, 2):
        for got, want in zip(out[r]["params"], _reference()):
            assert torch.equal(got, want), f"worker {r}: differs from the reference"
