"""The chain's steps called alone on a model nobody here wrote (torch's own
nn.TransformerEncoder), each equal to one process in float64 at world 2.

- `apply_tp` + `apply_recompute`: the local shards' gradients are the reference's slices;
  a weight tied under two names stays one Parameter after sharding;
- `apply_data_parallel` (DataParallel, ZeRO 1, ZeRO 2): one SGD step on half the batch
  per rank gives the reference's model (its loss on a fresh batch);
- `split_stages` (traced: the model has no pipeline_layers) + `Pipeline`: each stage's
  gradients are the reference's, by parameter name.
"""

import pytest
import torch
from torch import nn

import disttrain
from disttrain.mesh import Mesh
from disttrain.parallel import (
    Pipeline,
    apply_data_parallel,
    apply_recompute,
    apply_tp,
    split_stages,
    tie_stages,
)
from disttrain.parallel.pipeline import make_schedule
from disttrain.parallel.recompute import Recompute
from disttrain.testing import spawn

LR = 0.1
PLAN = {"layers.*.linear1": "colwise", "layers.*.linear2": "rowwise"}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0,
                                       batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).double()


def batch(n: int = 4, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 3, 8, generator=g, dtype=torch.float64),
            torch.randn(n, 3, 8, generator=g, dtype=torch.float64))


def loss_fn(out, y):
    return (out - y).pow(2).mean()


def tp_and_recompute():
    torch.set_num_threads(1)
    x, y = batch()
    ref = make_model()
    loss_fn(ref(x), y).backward()
    model = apply_recompute(apply_tp(make_model(), Mesh(tp=2), PLAN), ["layers.0", "layers.1"])
    assert all(isinstance(m, Recompute) for m in model.layers)
    loss = loss_fn(model(x), y)
    loss.backward()
    torch.testing.assert_close(loss, loss_fn(ref(x), y), rtol=1e-12, atol=0)
    r = disttrain.rank()
    for name, p in model.named_parameters():
        g = ref.get_parameter(name).grad
        if name.endswith(("linear1.weight", "linear1.bias")):
            g = g.chunk(2, 0)[r]
        elif name.endswith("linear2.weight"):
            g = g.chunk(2, 1)[r]
        torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-12, msg=name)
    tied = nn.Sequential(nn.Embedding(6, 4), nn.Linear(4, 6, bias=False))
    tied[1].weight = tied[0].weight
    apply_tp(tied, Mesh(tp=2), {"0": "vocab", "1": "colwise"})
    assert tied[1].weight is tied[0].weight and tied[0].weight.shape == (3, 4)
    return True


def data_parallel():
    torch.set_num_threads(1)
    x, y = batch()
    probe = batch(seed=2)
    ref = make_model()
    loss_fn(ref(x), y).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= LR * p.grad
        expected = loss_fn(ref(probe[0]), probe[1])
    r, group = disttrain.rank(), Mesh(dp=2).group("dp")
    for zero in (0, 1, 2):
        sgd = (lambda ps: torch.optim.SGD(ps, lr=LR)) if zero else None
        model = apply_data_parallel(make_model(), group, zero=zero, optimizer_factory=sgd)
        opt = model.optimizer if zero else torch.optim.SGD(model.parameters(), lr=LR)
        loss_fn(model(x.chunk(2)[r]), y.chunk(2)[r]).backward()
        opt.step()
        with torch.no_grad():
            got = loss_fn(model(probe[0]), probe[1])
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=0, msg=f"zero={zero}")
    return True


def pipeline():
    torch.set_num_threads(1)
    x, y = batch()
    ref = make_model()
    loss_fn(ref(x), y).backward()
    mesh = Mesh(pp=2)
    model = make_model()
    stage = mesh.local_rank("pp")
    chunks, owner = split_stages(model, mesh, example=(x[:2], y[:2]))
    tw = tie_stages(chunks, mesh, owner, [])
    assert not tw.sets and set(owner.values()) == {0, 1}
    pipe = Pipeline(chunks, make_schedule("1f1b", 2, 2)[stage], stage, 2, 2, loss_fn,
                    group=mesh.group("pp"), ranks=mesh.peers("pp"))
    loss = pipe.step(x, y)
    torch.testing.assert_close(loss, loss_fn(ref(x), y), rtol=1e-12, atol=0)
    names = [n for n, _ in chunks[0].named_parameters()]
    assert names and all(ref.get_parameter(n) is not None for n in names)
    for name, p in chunks[0].named_parameters():
        torch.testing.assert_close(p.grad, ref.get_parameter(name).grad, rtol=1e-10,
                                   atol=1e-12, msg=name)
    return sorted(names)


def each_step_alone():
    assert tp_and_recompute() and data_parallel()
    return pipeline()


@pytest.mark.timeout(90)
def test_each_step_alone_matches_one_process():
    stage0, stage1 = spawn(each_step_alone, 2, timeout=80)
    assert stage0 and stage1 and not set(stage0) & set(stage1)
    assert sorted(stage0 + stage1) == sorted(n for n, _ in make_model().named_parameters())
