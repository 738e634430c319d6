"""parallelize(..., zero=k): ZeRO over the mesh's dp axis, composed with TP (and PP).

Each mesh trains the tiny GPT of _gpt_ref with `zero=k` (the optimizer built by
parallelize from a factory, stepped as `model.optimizer`) and must match the
single-process reference: losses and clipped norms, first-step gradients (gathered over
dp and tp) and parameters after the steps.
"""

import pytest
import torch
import torch.nn.functional as F

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
    # gathers every stage's parameters to rank 0 in the model's own dtype.
    base = token_loss()
    out = run_zero(pp_dp, 1, schedule="1f1b", microbatches=2, precision="bf16",
                   loss_fn=lambda o, t: base(o.float(), t))
    if disttrain.rank() == 0:
        assert_update_matches(out[2], bf16_reference())
    return True


def bf16_reference(steps=ref.STEPS):
    """The single-process reference in ZeRO's mixed precision: a bf16 module, fp32 masters
    made from its bf16 values, fp32 gradients clipped and stepped, copied back to bf16."""
    model = ref.make_model().to(torch.bfloat16)
    x, y = ref.make_batch(8)
    masters = [p.detach().float() for p in model.parameters()]
    opt = torch.optim.SGD(masters, lr=ref.LR)
    for _ in range(steps):
        model.zero_grad()
        logits = model(x).float()
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        for m, p in zip(masters, model.parameters(), strict=True):
            m.grad = p.grad.float()
        torch.nn.utils.clip_grad_norm_(masters, ref.MAX_NORM)
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters(), strict=True):
                p.copy_(m)
    return {n: p.detach().float() for n, p in model.named_parameters()}


def assert_update_matches(params, want, rel=0.1):
    """Each tensor's distance to the same-precision reference is under `rel` of the
    reference's whole update (bf16 rounding in another order moves it by ~0.06 of it; a
    skipped step or an unstepped bias by 0.5 or more)."""
    init = {n: p.detach().to(torch.bfloat16).float() for n, p in ref.make_model().named_parameters()}
    assert params.keys() == want.keys()
    for name, w in want.items():
        assert params[name].dtype == torch.float32, name
        error, update = (params[name] - w).norm(), (w - init[name]).norm()
        assert error <= rel * update + 1e-6, (
            f"{name}: {error:.3g} from the bf16 reference, {error / update:.3f} of its update "
            f"{update:.3g}")


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
