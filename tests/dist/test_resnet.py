"""A ResNet with BatchNorm from a library (Hugging Face `ResNetForImageClassification`, tiny
config, float64, no download), unmodified, under DataParallel, ZeRO and a traced pipeline.

What one process must match depends on BatchNorm, which normalizes over the batch it
sees: replicas (plain BatchNorm) and micro-batches each see part of the batch, so the run
equals one process that accumulates gradients over those parts in order ("ghost
batches"); with SyncBatchNorm the replicas normalize over the global batch, so the run
equals one process on the whole batch. Running statistics are checked too: with plain
BatchNorm every replica starts each forward from dp rank 0's buffers (broadcast, as DDP),
so after the last step rank r holds one process's statistics updated from rank 0's part
in the earlier steps and from rank r's part in the last; with SyncBatchNorm every rank's
equal one process's on the whole batch.
"""

import pytest
import torch

import disttrain
from disttrain.mesh import Mesh
from disttrain.testing import spawn

transformers = pytest.importorskip("transformers")

STEPS, LR, BATCH = 2, 0.1, 8


def make_model():
    torch.manual_seed(0)
    cfg = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16],
                                    depths=[1, 1], layer_type="basic", num_labels=5)
    return transformers.ResNetForImageClassification(cfg).double()


def make_batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 3, 16, 16, generator=g, dtype=torch.float64)
    return x, torch.randint(5, (BATCH,), generator=g)


def _buffers(module) -> dict:
    return {n.removeprefix("module."): b.detach().clone() for n, b in module.named_buffers()}


def reference(parts=1, stats_from=None):
    """One process: each step accumulates loss/parts over `parts` slices of the batch in
    order; running statistics come from the slices i where stats_from(step, i) (default
    all)."""
    model = make_model()
    x, y = make_batch()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads0 = [], None
    for s in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for i, (xc, yc) in enumerate(zip(x.chunk(parts), y.chunk(parts))):
            kept = _buffers(model)
            loss = model(xc, labels=yc).loss / parts
            loss.backward()
            total += loss.item()
            if stats_from is not None and not stats_from(s, i):
                for name, b in model.named_buffers():
                    b.copy_(kept[name])
        losses.append(total)
        if s == 0:
            grads0 = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return losses, grads0, {n: p.detach().clone() for n, p in model.named_parameters()}, \
        _buffers(model)


def run(mesh, **kw):
    """Train on `mesh`; returns (losses, grads0, params on rank 0 else None, local buffers)."""
    model = make_model()
    x, y = make_batch()
    dp, d = mesh.size("dp"), mesh.local_rank("dp")
    x, y = x.chunk(dp)[d], y.chunk(dp)[d]
    pm = disttrain.parallelize(model, mesh, None, **kw)
    opt = pm.optimizer or torch.optim.SGD(pm.parameters(), lr=LR)
    losses, grads0 = [], None
    for s in range(STEPS):
        opt.zero_grad()
        losses.append(pm.train_step(x, y).item())
        if s == 0:
            grads0 = pm.full_state_dict(grads=True)
        opt.step()
    state = pm.full_state_dict()
    buffers = {}
    for chunk in pm.local_modules():
        buffers.update(_buffers(chunk))
    return losses, grads0, state if disttrain.rank() == 0 else None, buffers


def check(out, ref, params=True):
    losses, grads0, state, buffers = out
    ref_losses, ref_grads0, ref_state, ref_buffers = ref
    assert losses == pytest.approx(ref_losses, rel=1e-6)  # train_step returns fp32
    if params and state is not None:
        assert state.keys() == ref_state.keys()
        for name in ref_state:
            torch.testing.assert_close(grads0[name], ref_grads0[name], atol=1e-9, rtol=1e-6,
                                       msg=lambda m, n=name: f"grad {n}: {m}")
            torch.testing.assert_close(state[name], ref_state[name], atol=1e-9, rtol=1e-6,
                                       msg=lambda m, n=name: f"param {n}: {m}")
    assert buffers and set(buffers) <= set(ref_buffers)
    for name, b in buffers.items():
        torch.testing.assert_close(b, ref_buffers[name], atol=1e-9, rtol=1e-6,
                                   msg=lambda m, n=name: f"buffer {n}: {m}")


def _sgd(params):
    return torch.optim.SGD(params, lr=LR)


def data_parallel_and_zero():
    mesh, rank = Mesh(dp=2), disttrain.rank()
    # plain BatchNorm: each forward starts from rank 0's buffers and adds its own part
    ghost = reference(parts=2, stats_from=lambda s, i: i == (rank if s == STEPS - 1 else 0))
    whole = reference(parts=1)  # SyncBatchNorm: the global batch
    for zero in (0, 2):
        kw = dict(zero=zero, optimizer_factory=_sgd) if zero else {}
        out = run(mesh, **kw)
        check(out, ghost)
        out = run(mesh, sync_batchnorm=True, **kw)
        check(out, whole)  # every rank: the same running statistics
    return True


def traced_pipeline():
    expected = reference(parts=2)  # two micro-batches, in order, on every stage
    out = run(Mesh(pp=2), microbatches=2, example=make_batch())
    check(out, expected)  # each stage's own BatchNorm buffers
    with pytest.raises(ValueError, match="does not combine with SyncBatchNorm"):
        disttrain.parallelize(make_model(), Mesh(pp=2), None, sync_batchnorm=True,
                              example=make_batch())
    return True


def both():
    return data_parallel_and_zero() and traced_pipeline()


@pytest.mark.timeout(300)
def test_hf_resnet_batchnorm_under_dp_zero_and_traced_pipeline():
    assert spawn(both, 2, timeout=290) == [True, True]
