"""ZeRO mixed precision (bf16, fp16 + dynamic loss scaling) on real gloo ranks.

One world-2 spawn trains every (precision, stage) with AdamW, measures per-rank
model-state bytes against the paper's mixed-precision formulas, drives an fp16 run into
overflow, checks fp16 without a loss-scaling call is refused, and saves a mixed-precision
checkpoint that a group of 1 (world 2 -> 1) loads. The parent runs the same recipe by
hand in one process: a low-precision model, an fp32 master with torch AdamW, the two
ranks' micro-batches accumulated in the low precision (what the reduction sums), the
same loss-scale logic.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import disttrain
from disttrain import memory, plan
from disttrain.testing import spawn

WORLD, STEPS = 2, 4
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SCALER = {"init_scale": 2.0 ** 6, "growth_interval": 2}  # grows twice in 4 clean steps
CLIP = 0.3
OVERFLOW = {"init_scale": 2.0 ** 24, "backoff_factor": 2.0 ** -5, "growth_interval": 2}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 5))


def factory(ps):
    return torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1)


def sgd(ps):  # fp16 runs: unlike Adam, SGD's update shows a wrongly unscaled gradient
    return torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01)


FACTORY = {"bf16": factory, "fp16": sgd}


def batch(step):  # the global batch of `step`: 16 inputs (fp32) and class targets
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 8, generator=g) * 3, torch.randint(0, 5, (16,), generator=g)


def loss_fn(out, y):
    return nn.functional.cross_entropy(out.float(), y)


def train_zero(z, steps, start=0, clip=None):
    """Steps of Zero `z` on this rank's half of each batch; per step: skipped?, scale
    (and with `clip`, the gradient norm before clipping)."""
    rank, world = dist.get_rank(z.group), dist.get_world_size(z.group)
    log = []
    for s in range(start, start + steps):
        x, y = batch(s)
        z.optimizer.zero_grad()
        z.backward(loss_fn(z(x.chunk(world)[rank]), y.chunk(world)[rank]))
        norm = z.optimizer.clip_grad_norm_(clip) if clip else None
        z.optimizer.step()
        log.append((z.optimizer.last_step_skipped, z.optimizer.loss_scale)
                   + ((float(norm),) if clip else ()))
    return log


def floats(sd):
    return {k: v.float().clone() for k, v in sd.items()}


def run_all(folder):
    out = {"train": {}, "memory": {}}
    for precision in ("bf16", "fp16"):
        for stage in range(4):
            scaler = disttrain.LossScaler(**SCALER) if precision == "fp16" else None
            z = disttrain.Zero(make_model(), FACTORY[precision], stage=stage,
                               precision=precision, loss_scaler=scaler, bucket_mb=0.0005)
            log = train_zero(z, STEPS)
            out["train"][precision, stage] = {"master": z.fp32_state_dict(), "log": log,
                                              "params": floats(z.state_dict())}
    for stage in range(4):
        z = disttrain.Zero(make_mlp(), factory, stage=stage, precision="bf16")
        z.optimizer.zero_grad()
        z.backward(z(torch.randn(4, WIDTH)).float().square().mean())
        z.optimizer.step()
        ms = memory.model_state(z)
        out["memory"][stage] = (ms.params, ms.grads, ms.optimizer)
    z = disttrain.Zero(make_model(), sgd, stage=2, precision="fp16",
                       loss_scaler=disttrain.LossScaler(**OVERFLOW))
    out["overflow"] = {"log": train_zero(z, STEPS), "master": z.fp32_state_dict()}
    out["vote"] = {stage: one_rank_overflows(stage) for stage in (1, 3)}
    out["clip"] = {}
    for stage in (1, 3):  # clipping acts on the fp32 master gradients, unscaled
        z = disttrain.Zero(make_model(), sgd, stage=stage, precision="fp16",
                           loss_scaler=disttrain.LossScaler(**SCALER))
        out["clip"][stage] = {"log": train_zero(z, STEPS, clip=CLIP), "master": z.fp32_state_dict()}
    out["unscaled"] = unscaled_backward_is_refused()
    out["checkpoint"] = checkpoint_world_2_to_1(folder)
    return out


def one_rank_overflows(stage):
    """Only rank 1's own gradient shard holds an inf: every rank must skip the step."""
    z = disttrain.Zero(make_model(), sgd, stage=stage, precision="fp16",
                       loss_scaler=disttrain.LossScaler(**SCALER))
    before = z.fp32_state_dict()
    x, y = batch(0)
    z.backward(loss_fn(z(x.chunk(2)[dist.get_rank()]), y.chunk(2)[dist.get_rank()]))
    z.engine.prepare_step(average=False)  # reductions done: each rank holds its shard's grad
    if dist.get_rank() == 1:
        z.engine.shard_parameters()[0].grad[0] = float("inf")
    z.optimizer.step()
    after = z.fp32_state_dict()
    return {"skipped": z.optimizer.last_step_skipped, "scale": z.optimizer.loss_scale,
            "unchanged": all(torch.equal(before[k], after[k]) for k in before)}


def unscaled_backward_is_refused():
    z = disttrain.Zero(make_model(), factory, stage=1, precision="fp16")
    x, y = batch(0)
    errors = []
    try:
        z.backward(nn.functional.cross_entropy(z(x), y))  # an fp16 loss: refused
    except ValueError as err:
        errors.append(str(err))
    loss_fn(z(x), y).backward()
    try:
        z.optimizer.step()
    except RuntimeError as err:
        errors.append(str(err))
    return errors


def checkpoint_world_2_to_1(folder):
    """fp16 stage 2 at world 2: 2 steps, save; a group of one rank loads it at stage 3."""
    z = disttrain.Zero(make_model(), sgd, stage=2, precision="fp16",
                       loss_scaler=disttrain.LossScaler(**SCALER))
    train_zero(z, 3)
    disttrain.Checkpointer(folder).save(3, model=z, optimizer=z.optimizer)
    saved = {"master": z.fp32_state_dict(), "scale": z.optimizer.loss_scale,
             "tracker": z.optimizer.scaler.growth_tracker}
    solo = dist.new_group([0])
    if dist.get_rank() != 0:
        return {"saved": saved}
    one = disttrain.Zero(make_model(), sgd, stage=3, precision="fp16", group=solo)
    step = disttrain.Checkpointer(folder, group=solo).load(model=one, optimizer=one.optimizer,
                                                           rng=False)
    loaded = {"step": step, "master": one.fp32_state_dict(), "scale": one.optimizer.loss_scale,
              "tracker": one.optimizer.scaler.growth_tracker, "params": floats(one.state_dict())}
    momentum = one.optimizer.sharded_state_dict()["state"]["3.weight"]["momentum_buffer"]
    fresh = disttrain.Zero(make_model(), sgd, stage=1, precision="fp16", group=solo)
    fresh.load_state_dict(one.state_dict())  # a model state alone: masters follow it
    return {"saved": saved, "loaded": loaded, "momentum": momentum.local.clone(),
            "model_only": fresh.fp32_state_dict()}


WIDTH, LAYERS = 64, 4


def make_mlp() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


# ---- the single-process reference: the mixed-precision recipe by hand -----------------


def reference(precision, steps, scaler=None, clip=None):
    """(fp32 masters, low-precision params, per-step (skipped, scale[, norm])) after `steps`."""
    dtype = DTYPES[precision]
    model = make_model().to(dtype)
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    opt = FACTORY[precision](masters)
    cfg = {"init_scale": 1.0, "backoff_factor": 0.5, "growth_interval": 10 ** 9, **(scaler or {})}
    scale, tracker, log = cfg["init_scale"], 0, []
    for s in range(steps):
        x, y = batch(s)
        for p in params:
            p.grad = None
        for xr, yr in zip(x.chunk(WORLD), y.chunk(WORLD)):  # .grad sums in the low precision
            (loss_fn(model(xr.to(dtype)), yr) * scale).backward()
        grads = [p.grad.float() / (WORLD * scale) for p in params]
        skipped = not all(bool(g.isfinite().all()) for g in grads)
        norm = torch.stack([g.square().sum() for g in grads]).sum().sqrt()
        if clip and not skipped and clip / (norm + 1e-6) < 1:
            grads = [g * (clip / (norm + 1e-6)) for g in grads]
        if skipped:
            scale, tracker = scale * cfg["backoff_factor"], 0
        else:
            for m, g in zip(masters, grads):
                m.grad = g
            opt.step()
            with torch.no_grad():
                for p, m in zip(params, masters):
                    p.copy_(m)
            tracker += 1
            if tracker == cfg["growth_interval"]:
                scale, tracker = scale * 2, 0
        log.append((skipped, scale) + ((float(norm),) if clip else ()))
    names = [n for n, _ in model.named_parameters()]
    return ({n: m.detach() for n, m in zip(names, masters)},
            {n: p.detach().float() for n, p in zip(names, params)}, log)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every rank's run_all(), computed once for this module's tests."""
    return spawn(run_all, WORLD, str(tmp_path_factory.mktemp("zero-mixed-ckpt")), timeout=150)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_every_stage_equals_the_mixed_precision_recipe_by_hand(precision, results):
    out = results
    want_master, want_params, want_log = reference(
        precision, STEPS, SCALER if precision == "fp16" else None)
    if precision == "fp16":
        assert [scale for _, scale in want_log] == [64.0, 128.0, 128.0, 256.0]
    for stage in range(4):
        for rank in range(WORLD):
            got = out[rank]["train"][precision, stage]
            assert got["log"] == want_log, (stage, rank)
            for k in want_master:
                torch.testing.assert_close(got["master"][k], want_master[k], rtol=1e-5,
                                           atol=1e-6, msg=f"{precision} stage {stage}: {k}")
                torch.testing.assert_close(got["params"][k], want_params[k], rtol=0, atol=0,
                                           msg=f"{precision} stage {stage}: {k}")


@pytest.mark.timeout(180)
def test_fp16_overflow_skips_the_step_on_every_rank_and_backs_off_alike(results):
    out = results
    want_master, _, want_log = reference("fp16", STEPS, OVERFLOW)
    skipped = [s for s, _ in want_log]
    assert skipped[0] and not all(skipped), want_log  # the test does hit an overflow
    for rank in range(WORLD):
        got = out[rank]["overflow"]
        assert got["log"] == want_log, rank
        for k in want_master:
            torch.testing.assert_close(got["master"][k], want_master[k], rtol=1e-5, atol=1e-6)
    for rank in range(WORLD):  # an inf in one rank's own shard only: all ranks skip
        for stage in (1, 3):
            assert out[rank]["vote"][stage] == {"skipped": True, "scale": SCALER["init_scale"] / 2,
                                                "unchanged": True}, (rank, stage)
    # a skipped first step leaves the parameters as they started
    first, _, _ = reference("fp16", 1, OVERFLOW)
    init = {n: p.detach().to(torch.float16).float() for n, p in make_model().named_parameters()}
    assert all(torch.equal(first[k], init[k]) for k in init)


@pytest.mark.timeout(180)
def test_model_state_bytes_match_the_paper_mixed_precision_formulas(results):
    out = results
    psi = sum(p.numel() for p in make_mlp().parameters())
    for rank in range(WORLD):
        for stage in range(4):
            params, grads, opt = out[rank]["memory"][stage]
            want = plan.model_state_bytes(psi, WORLD, stage, "adamw", "mixed")
            for got, exp, part in ((params, want.params, "params"), (grads, want.grads, "grads"),
                                   (opt, want.optimizer, "optimizer (fp32 master + moments)")):
                assert got == pytest.approx(exp, rel=0.03), (rank, stage, part)
    # stage 0: 2 + 2 + 12 = 16 bytes per parameter, the paper's (2 + 2 + K) Psi
    assert sum(out[0]["memory"][0]) == pytest.approx(16 * psi, rel=0.03)


@pytest.mark.timeout(180)
def test_fp16_without_the_loss_scaling_call_or_with_an_fp16_loss_is_refused(results):
    for rank in range(WORLD):
        fp16_loss, unscaled = results[rank]["unscaled"]
        assert "compute the fp16 model's loss in fp32, e.g. loss_fn(out.float(), y)" in fp16_loss
        assert "call model.optimizer.backward(loss)" in unscaled


@pytest.mark.timeout(180)
def test_mixed_checkpoint_keeps_master_and_scaler_and_loads_at_world_1(results):
    out = results
    got = out[0]["checkpoint"]
    saved, loaded = got["saved"], got["loaded"]
    other = out[1]["checkpoint"]["saved"]  # every rank gathers the same full masters
    assert all(torch.equal(saved["master"][k], other["master"][k]) for k in saved["master"])
    assert loaded["step"] == 3
    assert loaded["scale"] == saved["scale"] == 128.0 and loaded["tracker"] == saved["tracker"] == 1
    for k, v in saved["master"].items():  # the fp32 master, not the fp16 parameters
        assert torch.equal(loaded["master"][k], v), k
        assert torch.equal(loaded["params"][k], v.to(torch.float16).float()), k
    assert got["momentum"].abs().sum() > 0  # the optimizer state came back too
    for k, v in got["model_only"].items():  # loading params alone re-derives the masters
        assert torch.equal(v, loaded["params"][k]), k


@pytest.mark.timeout(180)
def test_fp16_clipping_acts_on_the_unscaled_fp32_master_gradients(results):
    out = results
    want_master, _, want_log = reference("fp16", STEPS, SCALER, clip=CLIP)
    assert all(norm > CLIP for _, _, norm in want_log)  # the clip is active every step
    for rank in range(WORLD):
        for stage in (1, 3):
            got = out[rank]["clip"][stage]
            assert [entry[:2] for entry in got["log"]] == [entry[:2] for entry in want_log]
            torch.testing.assert_close([e[2] for e in got["log"]], [e[2] for e in want_log],
                                       rtol=1e-5, atol=0)
            for k in want_master:
                torch.testing.assert_close(got["master"][k], want_master[k], rtol=1e-5,
                                           atol=1e-6, msg=f"stage {stage}: {k}")
