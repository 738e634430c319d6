"""A checkpoint of a GPT tied across pipeline stages under ZeRO, loaded in other layouts.

Four gloo ranks train the tied GPT (embedding on stage 0, LM head on stage 1, one
weight) at pp=2 x dp=2 with ZeRO stage 1 and AdamW, save with `Checkpointer`, and
take one more step (the uninterrupted run). The checkpoint then loads into a
differently initialised pp=2 x dp=2 model with ZeRO stage 2: its full parameters must
equal the saved ones bitwise, the two stages' shards of the tied weight's AdamW state
must be equal, and one more step must give the uninterrupted run's parameters. This
process loads it into a plain tied GPT and AdamW (pp=1, world 1, one weight): the
parameters equal the saver's, the tied weight's exp_avg, exp_avg_sq and step equal a
single-process AdamW run of the same steps, and one more step gives the uninterrupted
run's parameters.
"""

import os

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F

import disttrain
from disttrain.checkpoint import Checkpointer
from disttrain.mesh import Mesh
from disttrain.models import GPT
from disttrain.parallel.parallelize import parallelize
from disttrain.testing import spawn
from tests.dist import _gpt_ref as ref

STEPS = 2
TIED = ("embed.tok.weight", "head.lm_head.weight")
HP = dict(lr=0.01, weight_decay=0.1)


def adamw(ps):
    return torch.optim.AdamW(ps, **HP)


def _build(zero, seed=None):
    model = ref.make_model(tie_embeddings=True)
    if seed is not None:  # other weights: the load must supply every value
        torch.manual_seed(seed)
        model = GPT(model.cfg)
    return parallelize(model, Mesh(pp=2, dp=2), zero=zero, optimizer_factory=adamw,
                       schedule="1f1b", microbatches=2)


def _step(pm, x, y):
    pm.optimizer.zero_grad()
    pm.train_step(x, y)
    pm.optimizer.step()


def _tied_state(pm):
    """This rank's shard pieces of the tied copy's AdamW state: {key: tensor}."""
    tree = pm.optimizer.sharded_state_dict()["state"]
    (name,) = [n for n in TIED if n in tree]
    return {k: (v.local if hasattr(v, "local") else torch.as_tensor(v)).clone()
            for k, v in tree[name].items()}


def save_and_resume(root):
    """Rank 0 writes the saved and next full params (uninterrupted and resumed)."""
    x, y = ref.make_batch(8)
    d = Mesh(pp=2, dp=2).local_rank("dp")
    x, y = x.chunk(2)[d], y.chunk(2)[d]
    pm = _build(zero=1)
    for _ in range(STEPS):
        _step(pm, x, y)
    Checkpointer(os.path.join(root, "ckpt")).save(STEPS, model=pm, optimizer=pm.optimizer)
    out = {"saved": pm.full_state_dict()}
    _step(pm, x, y)
    out["next"] = pm.full_state_dict()

    pm = _build(zero=2, seed=1234)
    assert Checkpointer(os.path.join(root, "ckpt")).load(
        model=pm, optimizer=pm.optimizer, rng=False) == STEPS
    out["loaded"] = pm.full_state_dict()
    tied = _tied_state(pm)
    _step(pm, x, y)
    out["resumed"] = pm.full_state_dict()
    if disttrain.rank() == 0:
        for tag, sd in out.items():
            sd = {k: v.clone() for k, v in sd.items()}  # the tied names share one tensor
            safetensors.torch.save_file(sd, os.path.join(root, f"{tag}.safetensors"))
    return tied


def _plain_step(model, opt, x, y):
    opt.zero_grad()
    logits = model(x)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
    opt.step()


def _close(a, b, what, atol=2e-6):
    torch.testing.assert_close(a, b, atol=atol, rtol=1e-4, msg=lambda m: f"{what}: {m}")


# NOTE: slow-marked for suite time: resharding at other worlds stays in the fast tier
# (test_checkpoint_reshard); this tied + ZeRO round trip runs with DISTTRAIN_SLOW=1.
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_tied_zero_checkpoint_loads_at_pp1_and_back_at_pp2_zero(tmp_path):
    tied = spawn(save_and_resume, 4, str(tmp_path), timeout=50)
    sd = {t: safetensors.torch.load_file(str(tmp_path / f"{t}.safetensors"))
          for t in ("saved", "next", "loaded", "resumed")}
    # back into pp=2 x dp=2 ZeRO 2: the saved bits, equal tied copies, the same next step
    assert sd["loaded"].keys() == sd["saved"].keys() and set(TIED) <= sd["saved"].keys()
    for name, t in sd["saved"].items():
        assert torch.equal(sd["loaded"][name], t), name
        _close(sd["resumed"][name], sd["next"][name], f"resumed at pp=2 ZeRO 2: {name}")
    for stage0, stage1 in ((0, 2), (1, 3)):  # same dp rank: same slice of the tied weight
        assert tied[stage0].keys() == tied[stage1].keys() == {"exp_avg", "exp_avg_sq", "step"}
        for key in tied[stage0]:
            assert torch.equal(tied[stage0][key], tied[stage1][key]), (stage0, key)

    # into one process, pp=1: one weight, the single-process AdamW's state
    torch.manual_seed(1234)
    model = GPT(ref.make_model(tie_embeddings=True).cfg)
    opt = adamw(model.parameters())
    assert Checkpointer(str(tmp_path / "ckpt")).load(model=model, optimizer=opt, rng=False) == STEPS
    assert model.head.lm_head.weight is model.embed.tok.weight
    full = dict(model.state_dict())
    assert full.keys() == sd["saved"].keys()
    for name, t in sd["saved"].items():
        assert torch.equal(full[name], t), name
    want = ref.make_model(tie_embeddings=True)
    want_opt = adamw(want.parameters())
    x, y = ref.make_batch(8)
    for _ in range(STEPS):
        _plain_step(want, want_opt, x, y)
    got_st = opt.state[model.embed.tok.weight]
    want_st = want_opt.state[want.embed.tok.weight]
    assert got_st.keys() == want_st.keys() == {"exp_avg", "exp_avg_sq", "step"}
    assert float(got_st["step"]) == float(want_st["step"]) == STEPS
    _close(got_st["exp_avg"], want_st["exp_avg"], "tied exp_avg")
    _close(got_st["exp_avg_sq"], want_st["exp_avg_sq"], "tied exp_avg_sq", atol=1e-9)
    _plain_step(model, opt, x, y)
    for name, t in model.state_dict().items():
        # NOTE: one process sums the batch in another order; where AdamW's v is tiny a
        # rounding moves the update by ~1e-6, while a wrong moment moves it by ~lr
        _close(t, sd["next"][name], f"resumed at pp=1: {name}", atol=2e-5)
