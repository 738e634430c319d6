"""parallelize(..., zero=k): ZeRO over the mesh's dp axis, composed with TP (and PP).

Each mesh trains the tiny GPT of _gpt_ref with `zero=k` (the optimizer built by
parallelize from a factory, stepped as `model.optimizer`) and must match the
single-process reference: losses and clipped norms, first-step gradients (gathered over
dp and tp) and parameters after the steps.
"""

import pytest
import torch

import disttrain
from disttrain.mesh import Mesh
from disttrain.models import GPT
from disttrain.parallel.parallelize import parallelize
from disttrain.testing import spawn
from tests.dist import _gpt_ref as ref


def run_zero(mesh, zero, steps=ref.STEPS, batch=8, **kw):
    """_gpt_ref.run_parallel, but the optimizer is parallelize's (ZeRO-sharded)."""
    model = ref.make_model()
    x, y = ref.make_batch(batch)
    dp, d = mesh.size("dp"), mesh.local_rank("dp")
    x, y = x.chunk(dp)[d], y.chunk(dp)[d]  # this replica's share of the global batch
    pm = parallelize(model, mesh, plan=GPT.tp_plan, zero=zero,
                     optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=ref.LR), **kw)
    losses, grads0 = [], None
    for s in range(steps):
        pm.optimizer.zero_grad()
        losses.append(pm.train_step(x, y).item())
        if s == 0:
            grads0 = pm.full_state_dict(grads=True)
        losses.append(pm.clip_grad_norm_(ref.MAX_NORM).item())
        pm.optimizer.step()
    params = pm.full_state_dict()
    return (losses, grads0, params) if disttrain.rank() == 0 else None


def dp_tp_every_stage():
    expected = ref.reference() if disttrain.rank() == 0 else None
    mesh = Mesh(dp=2, tp=2)
    for zero in (1, 2, 3):
        out = run_zero(mesh, zero, schedule="1f1b", microbatches=2)
        if disttrain.rank() == 0:
            ref.assert_matches_reference(out, expected)
    return True


def pp_dp_with_zero():
    expected = ref.reference() if disttrain.rank() == 0 else None
    mesh = Mesh(pp=2, dp=2)
    for zero in (1, 2, 3):
        out = run_zero(mesh, zero, schedule="1f1b", microbatches=2)
        if disttrain.rank() == 0:
            ref.assert_matches_reference(out, expected)
    return True


@pytest.mark.timeout(120)
def test_dp_x_tp_with_zero_1_2_3_matches_single_process():
    assert spawn(dp_tp_every_stage, 4, timeout=110) == [True] * 4


@pytest.mark.timeout(120)
def test_pp_x_dp_with_zero_1_2_3_matches_single_process():
    assert spawn(pp_dp_with_zero, 4, timeout=110) == [True] * 4
