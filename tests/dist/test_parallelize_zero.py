"""parallelize(..., zero=k): ZeRO over the mesh's dp axis, composed with TP (and PP).

Each mesh trains the tiny GPT of _gpt_ref with `zero=k` (the optimizer built by
parallelize from a factory, stepped as `model.optimizer`) and must match the
single-process reference: losses and clipped norms, first-step gradients (gathered over
dp and tp) and parameters after the steps.
"""

import pytest
import torch

import disttrain
from disttrain.mesh import Mesh, MeshShape
from disttrain.models import GPT
from disttrain.parallel.parallelize import ChunkOptimizers, parallelize, token_loss
from disttrain.parallel.zero import ZeroOptimizer
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
    several = kw.get("num_virtual", 1) > 1  # one ZeRO optimizer per chunk, behind one
    assert isinstance(pm.optimizer, ChunkOptimizers if several else ZeroOptimizer)
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


def every_stage_on_two_meshes():
    expected = ref.reference() if disttrain.rank() == 0 else None
    runs = [(Mesh(dp=2, tp=2), zero, dict(schedule="1f1b", microbatches=2)) for zero in (1, 2, 3)]
    pp_dp = Mesh(pp=2, dp=2)  # several chunks per stage: one ZeRO optimizer each, as one
    runs += [(pp_dp, 1, dict(schedule="gpipe", microbatches=2)),
             (pp_dp, 2, dict(schedule="interleaved", microbatches=2, num_virtual=2)),
             (pp_dp, 3, dict(schedule="interleaved", microbatches=2, num_virtual=2))]
    for mesh, zero, kw in runs:
        out = run_zero(mesh, zero, **kw)
        if disttrain.rank() == 0:
            ref.assert_matches_reference(out, expected)
    # bf16 ZeRO casts the stages after parallelize saw the model: full_state_dict still
    # gathers every stage's parameters to rank 0 in the model's own dtype, near fp32's.
    base = token_loss()
    out = run_zero(pp_dp, 1, schedule="1f1b", microbatches=2, precision="bf16",
                   loss_fn=lambda o, t: base(o.float(), t))
    if disttrain.rank() == 0:
        params = out[2]
        assert params.keys() == expected[2].keys()
        for name, want in expected[2].items():
            assert params[name].dtype == torch.float32, name
            torch.testing.assert_close(params[name], want, atol=5e-2, rtol=0, msg=name)
    return True


@pytest.mark.timeout(150)
def test_dp_x_tp_and_pp_x_dp_with_zero_1_2_3_match_single_process():
    assert spawn(every_stage_on_two_meshes, 4, timeout=140) == [True] * 4


@pytest.mark.timeout(30)
def test_bad_zero_arguments_say_how_to_fix_them():
    model = ref.make_model()
    with pytest.raises(ValueError, match="zero must be 0 .* or a ZeRO stage 1, 2 or 3; got 4"):
        parallelize(model, MeshShape(), zero=4)
    with pytest.raises(ValueError, match="pass optimizer_factory=lambda ps"):
        parallelize(model, MeshShape(), zero=2)
