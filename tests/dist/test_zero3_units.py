"""ZeRO stage 3 over modules whose forward reads their submodules' parameters directly.

`nn.MultiheadAttention` passes `out_proj.weight` to `F.multi_head_attention_forward`
without calling `out_proj`: it is gathered whole at its own forward (zero/units.py), also
inside `nn.TransformerEncoder` layers (whose inference fast path, which would read every
weight, is off while forward hooks are attached; reading a weight's dtype or shape
outside its forward is allowed);
a user's module doing the same is refused in the first forward with its name and the
fix (`whole_modules=`), and trains once given it. World 2 against a single-process
reference on the whole batch (same seed): the first step's update (lr * the averaged
gradient, SGD momentum's first step) and the parameters after 3 steps. ~6 s unloaded.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import disttrain
from disttrain.testing import spawn

STEPS, LR = 3, 0.1


class Attention(nn.Module):
    """MultiheadAttention then a linear head."""

    def __init__(self):
        super().__init__()
        self.att = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 4)

    def forward(self, x):  # (B, T, 8) -> (B, T, 4)
        x = x.to(self.head.weight.dtype)  # metadata of a unit not gathered yet: allowed
        return self.head(self.att(x, x, x, need_weights=False)[0])


class Reader(nn.Module):
    """Reads `fc.weight` after calling `fc`: a pattern stage 3 cannot see by itself."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):  # (B, T, 8) -> (B, T, 4)
        return self.head(torch.tanh(self.fc(x)) @ self.fc.weight)


def make(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "encoder":  # its fast-path checks read the layers' weights' metadata
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    return {"attention": Attention, "reader": Reader}[kind]()


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, 3, 8, generator=g), torch.randn(4, 3, 8, generator=g)


def loss_of(out, y):
    return nn.functional.mse_loss(out, y[..., :out.shape[-1]])


def run(model, opt, rank: int, world: int):
    """STEPS steps on this rank's half of each batch; (params after step 1, after all,
    eval output on the no-grad fast path)."""
    after = []
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        loss_of(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
        after.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    model.eval()
    with torch.no_grad():
        out = model(batch(STEPS)[0])
    return after[0], after[-1], out


def sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def train_all():
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for kind, whole in [("attention", ()), ("encoder", ()), ("reader", (Reader,))]:
        before = {k: v.clone() for k, v in make(kind).state_dict().items()}
        ref = make(kind)
        want = run(ref, sgd(ref.parameters()), 0, 1)
        zero = disttrain.Zero(make(kind), sgd, stage=3, whole_modules=whole)
        out[kind] = (before, want, run(zero, zero.optimizer, rank, world))
    zero = disttrain.Zero(make("reader"), sgd, stage=3)
    try:
        zero.optimizer.zero_grad()  # as a training loop starts (ends the recording pass)
        zero(batch(0)[0])
        out["refused"] = None
    except RuntimeError as e:
        out["refused"] = str(e)
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(train_all, 2, timeout=120)


@pytest.mark.parametrize("kind", ["attention", "encoder", "reader"])
def test_stage3_matches_single_process_where_a_forward_reads_submodule_params(kind, results):
    for rank_results in results:
        before, want, got = rank_results[kind]
        assert got[0].keys() == want[0].keys() == before.keys()
        for name, start in before.items():
            # step 1's update is LR * the gradient of the whole batch
            torch.testing.assert_close((start - got[0][name]) / LR,
                                       (start - want[0][name]) / LR,
                                       rtol=1e-4, atol=1e-5, msg=f"{kind} grad {name}")
            torch.testing.assert_close(got[1][name], want[1][name], rtol=1e-4, atol=1e-6,
                                       msg=f"{kind} {name}")
            assert not torch.equal(got[1][name], start), (kind, name)  # every one trained
        torch.testing.assert_close(got[2], want[2], rtol=1e-4, atol=1e-5)


def test_a_forward_reading_a_submodule_parameter_is_refused_with_the_fix(results):
    for rank, rank_results in enumerate(results):
        message = rank_results["refused"]
        assert message is not None and f"rank {rank}" in message, message
        assert "`fc.weight`" in message and "whole_modules=[Reader]" in message, message
        assert "setStorage" not in message, message
