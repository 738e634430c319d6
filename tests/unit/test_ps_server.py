"""Server pieces without processes: shard construction, optimizer step, snapshot/restore."""

import pytest
import torch

from disttrain.ps.policy import Async, KSync
from disttrain.ps.ring import plan_keys
from disttrain.ps.server import Server

SECRET = bytes(32)


def _server(policy, init, opt=lambda p: torch.optim.Adam(p, lr=0.1)):
    plan = plan_keys([(n, t.numel(), 4) for n, t in init.items()], 1, chunk_bytes=16)
    return Server(0, plan[0], init, policy, opt, [0, 1], SECRET)


def _close(server):
    server.ep.sock.close(linger=0)
    server._ctx.term()


@pytest.mark.timeout(20)
def test_chunked_shard_steps_like_whole_tensors_and_snapshots(tmp_path):
    torch.manual_seed(0)
    init = {"w": torch.randn(3, 5), "b": torch.randn(5)}
    s = _server(Async(), init)
    assert s.address.startswith("tcp://127.0.0.1:")
    assert s.keys[:2] == ["w#0", "w#1"] and len(s.keys) == 4 + 2  # 15 floats -> 4 chunks
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    ref_opt = torch.optim.Adam(ref.values(), lr=0.1)
    for _ in range(3):
        grads = {k: torch.randn_like(v) for k, v in init.items()}
        for k, p in ref.items():
            p.grad = grads[k]
        ref_opt.step()
        flat = {c.key: grads[c.name].reshape(-1)[c.start:c.stop] for c in s.chunks}
        s._apply([flat])
    for c in s.chunks:
        torch.testing.assert_close(s.params[c.key].detach(),
                                   ref[c.name].detach().reshape(-1)[c.start:c.stop])
    s.policy.version = 3
    path = str(tmp_path / "ps0.safetensors")
    s.snapshot(path)
    fresh = _server(Async(), {k: torch.zeros_like(v) for k, v in init.items()})
    fresh.restore(path)
    assert fresh.policy.version == 3
    for k in s.keys:
        torch.testing.assert_close(fresh.params[k], s.params[k])
        p, q = s.params[k], fresh.params[k]
        torch.testing.assert_close(fresh.optimizer.state[q]["exp_avg"], s.optimizer.state[p]["exp_avg"])
    _close(s)
    _close(fresh)


@pytest.mark.timeout(20)
def test_restore_of_another_model_names_missing_keys(tmp_path):
    s = _server(KSync(2), {"w": torch.ones(2)})
    path = str(tmp_path / "ps0.safetensors")
    s.snapshot(path)
    other = _server(KSync(2), {"v": torch.ones(2)})
    with pytest.raises(ValueError, match="lacks keys"):
        other.restore(path)
    _close(s)
    _close(other)
