"""With replicas=2, a policy whose rounds hold pushes of workers free to push again
(`Policy.runs_ahead`: KBatchAsync(k), KAsync(k), k > 1) answers a push `held` on receipt:
a worker's push().wait() returns while the push's round still waits for another worker,
so no worker blocks on a round it does not wait for (the cycle this used to hang in:
docs/design/parameter-server.md, "Replication after aggregation").

2 workers, 2 servers, k = 2: worker 0 pushes and waits; only once its wait returned does
worker 1 push, which closes every round. Before `held`, worker 0's wait never returned
(the round needs worker 1's push, which waits for worker 0): the spawn's timeout fails it.
Each push is a one-hot gradient at its own entry, lr 1, a constant step, so the final
parameters show each push applied once, averaged with the other.
"""

import secrets

import pytest
import torch
import torch.distributed as dist

import disttrain
from disttrain import ps
from disttrain.testing import spawn

W, S = 2, 2
ENV = {"DISTTRAIN_SERVERS": str(S), "DISTTRAIN_SECRET": secrets.token_hex(32)}


def _model():
    return torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(W)) for _ in range(4)])


def _policy(name):
    return {"kbatchasync": ps.KBatchAsync, "kasync": ps.KAsync}[name](2, step="constant")


def run(name):
    model, opt = _model(), (lambda p: torch.optim.SGD(p, lr=1.0))
    if disttrain.role() == "server":
        stats = ps.serve(model, _policy(name), opt, timeout=20, chunk_bytes=64, replicas=2,
                         name=name, manager="")
        return {"applied": stats["applied"], "version": stats["version"]}
    store, rank = dist.distributed_c10d._get_default_store(), disttrain.rank()
    conn = ps.attach(model, _policy(name), timeout=20, chunk_bytes=64, replicas=2, name=name,
                     manager="")
    if rank == 1:
        store.wait([f"{name}/held0"])  # NOTE: worker 0's push is held, its round still open
    conn.pull().wait()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
        p.grad[rank] = 1.0
    conn.push().wait()  # NOTE: worker 0: returns on `held`, the round waits for worker 1
    store.set(f"{name}/held{rank}", "1")
    store.wait([f"{name}/held{1 - rank}"])
    conn.pull().wait()
    conn.close()
    return {"params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", ["kbatchasync", "kasync"])
def test_a_held_push_lets_its_worker_go_on_and_is_applied_once(name):
    out = spawn(run, W + S, name, env=ENV, timeout=120)
    for w in range(W):  # each push applied once, averaged with the other one
        for p in out[w]["params"]:
            assert torch.equal(p, torch.full((W,), -0.5)), (w, p)
    for s in range(S):
        assert out[W + s] == {"applied": 2, "version": 1}, out[W + s]
