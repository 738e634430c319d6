"""Shared by the model-parallel tests: a tiny GPT, its data, and the 1-process reference.

Every rank builds the same model from the same seed; the reference trains it unsharded
on the whole global batch; a parallel run must match its losses, first-step gradients
and parameters after the last step.
"""

import pytest
import torch
import torch.nn.functional as F

import disttrain
from disttrain.models import GPT, GPTConfig
from disttrain.parallel.parallelize import parallelize

CFG = dict(vocab_size=32, block_size=8, n_layer=4, n_head=4, n_embd=16)
STEPS, LR, MAX_NORM = 2, 0.05, 0.8  # the first step's norm is ~1.19: clipping is active


def make_model(**over):
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**CFG, **over}))


def make_batch(batch=8, **over):
    cfg = {**CFG, **over}
    g = torch.Generator().manual_seed(1)
    x = torch.randint(cfg["vocab_size"], (batch, cfg["block_size"]), generator=g)
    y = torch.randint(cfg["vocab_size"], (batch, cfg["block_size"]), generator=g)
    return x, y


def reference(steps=STEPS, batch=8, **over):
    model = make_model(**over)
    x, y = make_batch(batch, **over)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads0 = [], None
    for s in range(steps):
        opt.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        losses.append(loss.item())
        if s == 0:
            grads0 = {n: p.grad.clone() for n, p in model.named_parameters()}
        losses.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
    return losses, grads0, {n: p.detach().clone() for n, p in model.named_parameters()}


def run_parallel(mesh, steps=STEPS, batch=8, plan_tp=True, **kw):
    """Train on `mesh`; rank 0 returns (losses and grad norms, grads0, params), others None."""
    model = make_model()
    x, y = make_batch(batch)
    dp, d = mesh.size("dp"), mesh.local_rank("dp")
    x, y = x.chunk(dp)[d], y.chunk(dp)[d]  # this replica's share of the global batch
    pm = parallelize(model, mesh, plan=GPT.tp_plan if plan_tp else None, **kw)
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    losses, grads0 = [], None
    for s in range(steps):
        opt.zero_grad()
        losses.append(pm.train_step(x, y).item())
        if s == 0:
            grads0 = pm.full_state_dict(grads=True)
        losses.append(pm.clip_grad_norm_(MAX_NORM).item())
        opt.step()
    params = pm.full_state_dict()
    if disttrain.rank() != 0:
        return None
    return losses, grads0, params, pm


def assert_matches_reference(out, ref, atol=2e-5, rtol=1e-4):
    losses, grads0, params = out[:3]
    ref_losses, ref_grads0, ref_params = ref
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    assert grads0.keys() == ref_grads0.keys() and params.keys() == ref_params.keys()
    for name in ref_params:
        torch.testing.assert_close(grads0[name], ref_grads0[name], atol=atol, rtol=rtol,
                                   msg=lambda m, n=name: f"grad {n}: {m}")
        torch.testing.assert_close(params[name], ref_params[name], atol=atol, rtol=rtol,
                                   msg=lambda m, n=name: f"param {n}: {m}")
