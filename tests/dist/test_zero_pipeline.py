"""ZeRO composed with pipeline and tensor parallelism, on real gloo ranks.

1. fp16 with pp=2 x dp=2 (ZeRO 1 and 2, the second with tied embeddings) and tp=2 x
   dp=2 (ZeRO 2) matches the mixed-precision recipe by hand in one process (fp16 model,
   fp32 masters, SGD with momentum, dynamic loss scale, the gradient norm clipped on the
   unscaled fp32 gradients): loss-scale log exactly, losses, norms, masters and fp16
   parameters closely (micro-batches accumulate in fp16 in another order).
   An inf put into one rank's shard gradient on one stage only makes every rank of the
   job skip the step and back off alike (interleaved: every chunk, one vote).
2. A GPT whose embedding and LM head are tied across pp=2 stages, with dp=2 and ZeRO 1,
   2, 3, matches the single-process tied GPT; the two copies stay bitwise equal.
3. `reduce_dtype=torch.float32` under bf16 equals the recipe by hand with an fp32 sum of
   the ranks' bf16 gradients, and the reduction's counted bytes double.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import disttrain
from disttrain.mesh import Mesh
from disttrain.models import GPT
from disttrain.parallel.parallelize import parallelize, token_loss
from disttrain.testing import spawn
from tests.dist import _gpt_ref as ref
from tests.dist import test_zero_mixed as mlp

STEPS = 3
SCALER = {"init_scale": 2.0 ** 8, "growth_interval": 2}  # 256, 256, 512 over the steps
TIED = ("embed.tok.weight", "head.lm_head.weight")
CLIP = 0.4  # below every fp16 step's norm: clipping is active throughout


def sgd(ps):  # momentum carries a wrongly unscaled or unclipped gradient into later steps
    return torch.optim.SGD(ps, lr=ref.LR, momentum=0.9)


def fp16_run(mesh, zero, tie=False, steps=STEPS, **kw):
    """Train the GPT in fp16 ZeRO; (log of (skipped, scale, loss, norm), masters, params)."""
    model = ref.make_model(tie_embeddings=tie)
    x, y = ref.make_batch(8)
    dp, d = mesh.size("dp"), mesh.local_rank("dp")
    x, y = x.chunk(dp)[d], y.chunk(dp)[d]
    pm = parallelize(model, mesh, plan=GPT.tp_plan if mesh.size("tp") > 1 else None,
                     zero=zero, optimizer_factory=sgd, microbatches=2,
                     precision="fp16", loss_scaler=disttrain.LossScaler(**SCALER),
                     **kw)
    opt, log = pm.optimizer, []
    for _ in range(steps):
        opt.zero_grad()
        loss = pm.train_step(x, y).item()  # parallelize scaled it and unscales it
        norm = pm.clip_grad_norm_(CLIP).item()  # max_norm as in fp32
        opt.step()
        log.append((opt.last_step_skipped, opt.loss_scale, loss, norm))
    masters = {}
    if mesh.size("tp") == 1:
        for c in pm.chunks:
            masters.update(c.fp32_state_dict())  # collective over dp
    return log, masters, pm.full_state_dict()


def fp16_reference(steps=STEPS, dp=2, tie=False):
    """The recipe by hand: fp16 GPT, fp32 masters, each dp share's backward of its loss
    times the scale summed in fp16, / (dp * scale), clipped, SGD on the masters."""
    model = ref.make_model(tie_embeddings=tie).to(torch.float16)
    names, params = zip(*model.named_parameters())
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    opt = sgd(masters)
    x, y = ref.make_batch(8)
    scale, tracker, log = SCALER["init_scale"], 0, []
    for _ in range(steps):
        for p in params:
            p.grad = None
        loss = 0.0
        for xr, yr in zip(x.chunk(dp), y.chunk(dp)):
            logits = model(xr).float()
            part = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), yr.reshape(-1))
            (part * scale).backward()
            loss += part.item() / dp
        grads = [p.grad.float() / (dp * scale) for p in params]
        assert all(bool(g.isfinite().all()) for g in grads)
        norm = torch.stack([g.square().sum() for g in grads]).sum().sqrt()
        grads = [g * min(1.0, CLIP / (float(norm) + 1e-6)) for g in grads]
        for m, g in zip(masters, grads):
            m.grad = g
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
        tracker += 1
        if tracker == SCALER["growth_interval"]:
            scale, tracker = scale * 2, 0
        log.append((False, scale, loss, float(norm)))
    return log, dict(zip(names, (m.detach() for m in masters))), \
        {n: p.detach().float() for n, p in zip(names, params)}


def overflow_on_one_stage(mesh, zero, **kw):
    """Step 1: an inf only in the last global rank's shard gradient (last stage, last
    chunk). Every rank must skip, back off alike and keep its masters; step 2 trains."""
    model = ref.make_model()
    x, y = ref.make_batch(8)
    dp, d = mesh.size("dp"), mesh.local_rank("dp")
    pm = parallelize(model, mesh, zero=zero, optimizer_factory=sgd, microbatches=2,
                     precision="fp16", loss_scaler=disttrain.LossScaler(**SCALER),
                     **kw)
    before = [c.fp32_state_dict() for c in pm.chunks]
    out = []
    for step in range(2):
        pm.optimizer.zero_grad()
        pm.train_step(x.chunk(dp)[d], y.chunk(dp)[d])
        for c in pm.chunks:
            c.engine.finish()  # this rank's reductions are done (local wait)
        if step == 0 and dist.get_rank() == dist.get_world_size() - 1:
            pm.chunks[-1].engine.shard_grads()[0][0] = float("inf")
        norm = pm.clip_grad_norm_(ref.MAX_NORM).item()
        pm.optimizer.step()
        after = [c.fp32_state_dict() for c in pm.chunks]
        kept = all(torch.equal(b[k], a[k]) for b, a in zip(before, after) for k in b)
        out.append((pm.optimizer.last_step_skipped, pm.optimizer.loss_scale, norm, kept))
        before = after
    return out


def tied_zero(mesh, zero):
    """The tied GPT at pp=2 x dp=2 with ZeRO `zero` (fp32): rank 0 returns losses and
    norms, first-step gradients and final parameters; every rank its tied copy per step."""
    model = ref.make_model(tie_embeddings=True)
    x, y = ref.make_batch(8)
    dp, d = mesh.size("dp"), mesh.local_rank("dp")
    pm = parallelize(model, mesh, zero=zero, schedule="1f1b", microbatches=2,
                     optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=ref.LR))
    losses, grads0, copies = [], None, []
    for s in range(STEPS):
        pm.optimizer.zero_grad()
        losses.append(pm.train_step(x.chunk(dp)[d], y.chunk(dp)[d]).item())
        if s == 0:
            grads0 = pm.full_state_dict(grads=True)
        losses.append(pm.clip_grad_norm_(ref.MAX_NORM).item())
        pm.optimizer.step()
        full = pm.chunks[0].fp32_state_dict()  # collective over dp
        copies.append(next(full[n] for n in TIED if n in full).clone())
    return (losses, grads0, pm.full_state_dict()), copies


def run_all():
    out = {"fp16": {}, "overflow": {}, "tied": {}}
    pp_dp, tp_dp = Mesh(pp=2, dp=2), Mesh(dp=2, tp=2)
    out["fp16"]["pp", 1, False] = fp16_run(pp_dp, 1, schedule="gpipe")
    out["fp16"]["pp", 2, True] = fp16_run(pp_dp, 2, tie=True, schedule="1f1b")
    out["fp16"]["tp", 2, False] = fp16_run(tp_dp, 2)
    out["overflow"]["interleaved", 1] = overflow_on_one_stage(
        pp_dp, 1, schedule="interleaved", num_virtual=2)
    out["overflow"]["1f1b", 3] = overflow_on_one_stage(pp_dp, 3, schedule="1f1b")
    for zero in (1, 2, 3):
        out["tied"][zero] = tied_zero(pp_dp, zero)
    out["double_scaling"] = loss_scaled_twice_is_refused(tp_dp)
    return out


def loss_scaled_twice_is_refused(mesh):
    """The pre-parallelize habit (loss_fn calling scale_loss) would scale twice."""
    held, base = {}, token_loss(mesh.group("tp"))  # vocab-parallel cross-entropy
    pm = parallelize(ref.make_model(), mesh, plan=GPT.tp_plan, zero=1, optimizer_factory=sgd,
                     precision="fp16",
                     loss_fn=lambda out, y: held["pm"].optimizer.scale_loss(base(out.float(), y)))
    held["pm"] = pm
    x, y = ref.make_batch(4)
    try:
        pm.train_step(x, y)
    except ValueError as err:
        return str(err)
    return None


@pytest.fixture(scope="module")
def results():
    """Every rank's run_all(), computed once for this module's tests."""
    return spawn(run_all, 4, timeout=110)


def assert_close_log(got, want, where):
    assert [g[:2] for g in got] == [w[:2] for w in want], where  # skipped, scale: exact
    for g, w in zip(got, want):
        assert g[2] == pytest.approx(w[2], rel=2e-4), (where, "loss", got, want)
        assert g[3] == pytest.approx(w[3], rel=2e-3), (where, "norm", got, want)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("key", [("pp", 1, False), ("pp", 2, True), ("tp", 2, False)])
def test_fp16_zero_under_pp_and_tp_matches_the_recipe_by_hand(key, results):
    out = results
    tie = key[2]
    want_log, want_masters, want_params = fp16_reference(tie=tie)
    assert [s for _, s, _, _ in want_log] == [256.0, 512.0, 512.0]
    assert all(norm > CLIP for *_, norm in want_log)  # clipping is active
    for rank in range(4):
        log, masters, _ = out[rank]["fp16"][key]
        assert_close_log(log, want_log, (key, rank))
        for name, m in masters.items():  # this rank's stage, full over dp
            want = want_masters[TIED[0] if tie and name in TIED else name]
            torch.testing.assert_close(m, want, rtol=1e-3, atol=1e-4, msg=name)
    params = out[0]["fp16"][key][2]  # the whole model (fp16 values), gathered on rank 0
    assert params.keys() == want_params.keys() | ({TIED[1]} if tie else set())
    for name, got in params.items():
        want = want_params[TIED[0] if tie and name in TIED else name]
        torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-4, msg=name)  # ~2 fp16 ulps
    if tie:
        assert torch.equal(params[TIED[0]], params[TIED[1]])


@pytest.mark.timeout(150)
@pytest.mark.parametrize("key", [("interleaved", 1), ("1f1b", 3)])
def test_fp16_overflow_on_one_stage_skips_on_every_rank_and_backs_off_alike(key, results):
    out = results
    for rank in range(4):
        (skipped, scale, norm, kept), (skipped2, scale2, norm2, kept2) = out[rank]["overflow"][key]
        assert skipped and scale == SCALER["init_scale"] / 2 and norm == float("inf") and kept, \
            (key, rank)
        assert not skipped2 and scale2 == scale and norm2 < float("inf") and not kept2, (key, rank)
        assert out[rank]["overflow"][key][1][2] == out[0]["overflow"][key][1][2]  # same norm


@pytest.mark.timeout(150)
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_tied_across_stages_with_zero_matches_single_process_and_copies_stay_equal(zero, results):
    out = results
    (losses, grads0, params), _ = out[0]["tied"][zero]
    expected = ref.reference(steps=STEPS, tie_embeddings=True)
    assert torch.equal(params[TIED[1]], params[TIED[0]])
    ref.assert_matches_reference((losses, {k: grads0[k] for k in expected[1]},
                                  {k: params[k] for k in expected[2]}), expected)
    for first, last in ((0, 2), (1, 3)):  # (stage 0, stage 1) of dp rank 0 and of dp rank 1
        for step, (a, b) in enumerate(zip(out[first]["tied"][zero][1],
                                          out[last]["tied"][zero][1])):
            assert torch.equal(a, b), f"zero={zero}: tied copies differ after step {step}"


@pytest.mark.timeout(150)
def test_a_loss_fn_that_scales_the_loss_itself_is_refused_with_the_fix(results):
    for rank in range(4):
        assert "return the plain fp32 loss" in results[rank]["double_scaling"]


# ---- reduce_dtype: fp32 reduction under bf16 ------------------------------------------


def reduce_in_fp32():
    out = {}
    for stage in range(4):
        z = disttrain.Zero(mlp.make_model(), mlp.factory, stage=stage, precision="bf16",
                           reduce_dtype=torch.float32, bucket_mb=0.0005)
        out["train", stage] = {"log": mlp.train_zero(z, STEPS), "master": z.fp32_state_dict(),
                               "params": mlp.floats(z.state_dict())}
        for dtype in (None, torch.float32):  # bytes of one step, counted by the collectives
            z = disttrain.Zero(mlp.make_model(), mlp.factory, stage=stage, precision="bf16",
                               reduce_dtype=dtype)
            z.comm_stats.reset()
            mlp.train_zero(z, 1)
            out["bytes", stage, dtype] = dict(z.comm_stats.sent)
    return out


def fp32_reduction_reference(steps=STEPS):
    """The bf16 recipe, but each rank's bf16 gradient is summed with the other's in fp32."""
    model = mlp.make_model().to(torch.bfloat16)
    names, params = zip(*model.named_parameters())
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    opt = mlp.factory(masters)
    for s in range(steps):
        x, y = mlp.batch(s)
        total = [torch.zeros_like(m) for m in masters]
        for xr, yr in zip(x.chunk(2), y.chunk(2)):
            for p in params:
                p.grad = None
            mlp.loss_fn(model(xr.to(torch.bfloat16)), yr).backward()
            total = [t + p.grad.float() for t, p in zip(total, params)]
        for m, t in zip(masters, total):
            m.grad = t / 2
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
    return dict(zip(names, (m.detach() for m in masters))), \
        {n: p.detach().float() for n, p in zip(names, params)}


@pytest.mark.timeout(60)
def test_reduce_dtype_fp32_equals_the_recipe_with_an_fp32_sum_and_doubles_reduce_bytes():
    out = spawn(reduce_in_fp32, 2, timeout=50)
    want_master, want_params = fp32_reduction_reference()
    low_master, _, _ = mlp.reference("bf16", STEPS)  # bf16 sums: must differ somewhere
    assert any(not torch.equal(want_master[k], low_master[k]) for k in want_master)
    for stage in range(4):
        for rank in range(2):
            got = out[rank]["train", stage]
            assert got["log"] == [(False, 1.0)] * STEPS
            for k in want_master:
                torch.testing.assert_close(got["master"][k], want_master[k], rtol=1e-6,
                                           atol=1e-7, msg=f"stage {stage}: {k}")
                torch.testing.assert_close(got["params"][k], want_params[k], rtol=0, atol=0,
                                           msg=f"stage {stage}: {k}")
        low, high = out[0]["bytes", stage, None], out[0]["bytes", stage, torch.float32]
        op = "all_reduce" if stage == 0 else "reduce_scatter"
        assert high[op] == 2 * low[op] > 0, (stage, low, high)
        if stage in (1, 2):  # parameters are still all-gathered in bf16
            assert high["all_gather"] == low["all_gather"] > 0
