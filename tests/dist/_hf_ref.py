"""Shared by the any-model tests: a tiny Hugging Face GPT-2 (built from a config, no
download), its data, and the one-process reference it must match.

The model computes its own loss (`model(x, labels=y).loss`); every rank builds it from the
same seed in float64; a parallel run must match the reference's losses and gradient norms,
first-step gradients and parameters after the last step.
"""

import pytest
import torch

import disttrain
from disttrain.parallel.parallelize import parallelize

transformers = pytest.importorskip("transformers")

CFG = dict(vocab_size=32, n_positions=16, n_embd=16, n_layer=4, n_head=4, resid_pdrop=0.0,
           embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
STEPS, LR, MAX_NORM = 2, 0.1, 0.5
SEQ = 8


def make_model(kind="gpt2", **over):
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=16,
                                       bos_token_id=0, eos_token_id=0, **over)
        return transformers.LlamaForCausalLM(cfg).double()
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**CFG, **over})).double()


def make_batch(batch=8):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(CFG["vocab_size"], (batch, SEQ), generator=g)
    return x, torch.randint(CFG["vocab_size"], (batch, SEQ), generator=g)


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def reference(steps=STEPS, batch=8, kind="gpt2"):
    model = make_model(kind)
    x, y = make_batch(batch)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out, grads0 = [], None
    for s in range(steps):
        opt.zero_grad()
        loss = model(x, labels=y).loss
        loss.backward()
        out.append(loss.item())
        if s == 0:
            grads0 = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
        out.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
    return out, grads0, params(model)


def run_parallel(mesh, steps=STEPS, batch=8, plan=None, kind="gpt2", probe=None, **kw):
    """Train on `mesh`; rank 0 returns (losses and norms, grads0, params), others None.
    probe: a dict that receives the ParallelModel as probe["model"]."""
    model = make_model(kind)
    x, y = make_batch(batch)
    dp, d = mesh.size("dp"), mesh.local_rank("dp")
    x, y = x.chunk(dp)[d], y.chunk(dp)[d]
    pm = parallelize(model, mesh, plan, **kw)
    if probe is not None:
        probe["model"] = pm
    opt = pm.optimizer or torch.optim.SGD(pm.parameters(), lr=LR)
    out, grads0 = [], None
    for s in range(steps):
        opt.zero_grad()
        out.append(pm.train_step(x, y).item())
        if s == 0:
            grads0 = pm.full_state_dict(grads=True)
        out.append(pm.clip_grad_norm_(MAX_NORM).item())
        opt.step()
    state = pm.full_state_dict()
    return (out, grads0, state) if disttrain.rank() == 0 else None


def assert_matches(out, ref, atol=1e-9, rtol=1e-6):
    losses, grads0, state = out
    ref_losses, ref_grads0, ref_state = ref
    assert losses == pytest.approx(ref_losses, rel=1e-6)  # transformers: fp32 loss
    assert state.keys() == ref_state.keys()
    for name in ref_state:
        torch.testing.assert_close(grads0[name], ref_grads0[name], atol=atol, rtol=rtol,
                                   msg=lambda m, n=name: f"grad {n}: {m}")
        torch.testing.assert_close(state[name], ref_state[name], atol=atol, rtol=rtol,
                                   msg=lambda m, n=name: f"param {n}: {m}")
