"""Weights tied across pipeline stages (Megatron's embedding group) against one process.

A GPT with `tie_embeddings=True` keeps one weight for its token embedding (first stage)
and its LM head (last stage). Split over pp=2 (and pp=2 x tp=2), each stage holds a
copy; after each step the copies must be bitwise equal, and losses, gradients and
parameters must match the single-process tied GPT. A tied pp=2 checkpoint loads into
one process as one weight. The two pp=2 checks share one spawn of 2 processes (each start
imports torch: seconds of suite time).
"""

import os

import pytest
import torch

import disttrain
from disttrain.checkpoint import Checkpointer
from disttrain.mesh import Mesh, MeshShape
from disttrain.models import GPT
from disttrain.parallel.parallelize import parallelize
from disttrain.parallel.tensor.tied import retie, tied_names
from disttrain.testing import spawn
from tests.dist import _gpt_ref as ref

TIED = ("embed.tok.weight", "head.lm_head.weight")


def run_tied(mesh, steps=3, **kw):
    """Train the tied GPT; every rank returns its tied copy after each step (or None)."""
    model = ref.make_model(tie_embeddings=True)
    x, y = ref.make_batch(8)
    dp, d = mesh.size("dp"), mesh.local_rank("dp")
    x, y = x.chunk(dp)[d], y.chunk(dp)[d]  # this replica's share of the global batch
    pm = parallelize(model, mesh, plan=GPT.tp_plan if mesh.size("tp") > 1 else None, **kw)
    opt = torch.optim.SGD(pm.parameters(), lr=ref.LR)
    losses, grads0, copies = [], None, []
    for s in range(steps):
        opt.zero_grad()
        losses.append(pm.train_step(x, y).item())
        if s == 0:
            grads0 = pm.full_state_dict(grads=True)
        losses.append(pm.clip_grad_norm_(ref.MAX_NORM).item())
        opt.step()
        mine = {n: p for c in pm.local_modules() for n, p in c.named_parameters() if n in TIED}
        copies.append(next(iter(mine.values())).detach().clone() if mine else None)
    return losses, grads0, pm.full_state_dict(), pm, opt, copies


def check_against_reference(out, steps=3):
    losses, grads0, params = out[:3]
    expected = ref.reference(steps=steps, tie_embeddings=True)
    # one weight under two names, as state_dict() of the tied GPT has it
    assert params[TIED[1]] is params[TIED[0]] and grads0[TIED[1]] is grads0[TIED[0]]
    ref.assert_matches_reference((losses, {k: grads0[k] for k in expected[1]},
                                  {k: params[k] for k in expected[2]}), expected)


def tied_pp2(ckpt_dir):
    mesh = Mesh(pp=2)
    out = run_tied(mesh, schedule="1f1b", microbatches=2)
    if disttrain.rank() == 0:
        check_against_reference(out)
    pm, opt = out[3], out[4]
    Checkpointer(ckpt_dir).save(3, model=pm, optimizer=opt)
    return out[5]


def tied_pp2_tp2():
    """pp=2 x tp=2, then with recompute too; then dp=2 x tp=2 (tied in one stage)."""
    mesh = Mesh(pp=2, tp=2)
    copies = []
    for recompute in (False, True):
        out = run_tied(mesh, schedule="1f1b", microbatches=2, recompute=recompute)
        if disttrain.rank() == 0:
            check_against_reference(out)
        copies += out[5]
    out = run_tied(Mesh(dp=2, tp=2), recompute=True)
    if disttrain.rank() == 0:
        check_against_reference(out)
        tied = out[3].local_modules()[0]
        assert tied.head.lm_head.weight is tied.embed.tok.weight  # re-tied after TP
    return copies


def assert_copies_bitwise_equal(copies, first, last):
    """Rank `first` (stage 0) and rank `last` (last stage) hold equal tied copies."""
    for step, (a, b) in enumerate(zip(copies[first], copies[last])):
        assert torch.equal(a, b), f"tied copies differ after step {step}"


def _stepped_adamw_tied_model():
    """The pp=1 model and its AdamW after one step (the state test_tied_optimizer_... moves)."""
    model, opt = _adamw_tied_model()
    x, y = ref.make_batch(4)
    model(x).logsumexp(-1).mean().backward()
    opt.step()
    return model, opt


def both_pp2_jobs(ckpt, src, dst):
    return {"tied": tied_pp2(ckpt), "moved": load_pp1_into_pp2_and_save(src, dst)}


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    """One spawn at pp=2 for both checks: (folders, the pp1 model and optimizer, results)."""
    tmp = tmp_path_factory.mktemp("tied")
    folders = {k: os.path.join(tmp, k) for k in ("ckpt", "pp1", "pp2")}
    model, opt = _stepped_adamw_tied_model()
    Checkpointer(folders["pp1"]).save(1, model=model, optimizer=opt)
    out = spawn(both_pp2_jobs, 2, folders["ckpt"], folders["pp1"], folders["pp2"], timeout=120)
    return folders, model, opt, out


@pytest.mark.timeout(130)  # NOTE: the first test to ask for `pp2` waits for its spawn
def test_tied_pp2_matches_single_process_and_checkpoint_loads_into_pp1(pp2):
    folders, _, _, out = pp2
    ckpt = folders["ckpt"]
    copies = [r["tied"] for r in out]
    assert_copies_bitwise_equal(copies, 0, 1)
    # pp=2 -> one process: both names fill the one shared weight
    full = ref.make_model(tie_embeddings=True)
    torch.nn.init.zeros_(full.embed.tok.weight)
    opt = torch.optim.SGD(full.parameters(), lr=ref.LR)
    assert Checkpointer(ckpt).load(model=full, optimizer=opt) == 3
    assert full.head.lm_head.weight is full.embed.tok.weight
    _, _, expected = ref.reference(steps=3, tie_embeddings=True)
    for name, p in full.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], atol=2e-5, rtol=1e-4)


@pytest.mark.timeout(90)
def test_tied_pp2_x_tp2_and_dp2_x_tp2_with_recompute_match_single_process():
    copies = spawn(tied_pp2_tp2, 4, timeout=80)
    assert_copies_bitwise_equal(copies, 0, 2)  # tp rank 0: ranks 0 (stage 0) and 2 (stage 1)
    assert_copies_bitwise_equal(copies, 1, 3)
    assert not torch.equal(copies[0][0], copies[1][0])  # different vocab shards


def test_embedding_groups_pair_first_and_last_stage_of_each_dp_tp_line():
    assert MeshShape(pp=2, tp=2).stage_groups((0, 1)) == [[0, 2], [1, 3]]
    assert MeshShape(pp=4, dp=2).stage_groups((0, 3)) == [[0, 6], [1, 7]]
    with pytest.raises(ValueError, match="stage 4 is outside 0..3"):
        MeshShape(pp=4).stage_groups((0, 4))


def test_bad_tied_sets_say_how_to_fix():
    model = ref.make_model(tie_embeddings=True)
    assert tied_names(model) == [list(TIED)]
    assert tied_names(ref.make_model()) == []
    with pytest.raises(ValueError, match="one shape"):
        tied_names(model, [["embed.tok.weight", "embed.pos.weight"]])
    with pytest.raises(ValueError, match="not found"):
        tied_names(model, [["embed.tok.weight", "head.lm_head.wieght"]])
    untied = ref.make_model()
    with pytest.raises(ValueError, match="tie them in the model first"):
        tied_names(untied, [list(TIED)])
    # as if TP had split the embedding's vocabulary but left the head whole
    untied.embed.tok.weight = torch.nn.Parameter(untied.embed.tok.weight[:16].detach())
    with pytest.raises(ValueError, match="'vocab' and output layer 'colwise'"):
        retie(untied, [list(TIED)])


def _adamw_tied_model():
    model = ref.make_model(tie_embeddings=True)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def load_pp1_into_pp2_and_save(src, dst):
    torch.manual_seed(7)  # different weights: the load must overwrite them
    pm = parallelize(GPT(ref.make_model(tie_embeddings=True).cfg), Mesh(pp=2), microbatches=1)
    opt = torch.optim.AdamW(pm.parameters(), lr=0.1)
    Checkpointer(src).load(model=pm, optimizer=opt)
    Checkpointer(dst).save(1, model=pm, optimizer=opt)
    p = {n: p for c in pm.local_modules() for n, p in c.named_parameters() if n in TIED}
    (p,) = p.values()
    return p.detach().clone(), opt.state[p]["exp_avg"].clone()


@pytest.mark.timeout(130)
def test_tied_optimizer_state_moves_pp1_to_pp2_and_back(pp2):
    folders, model, opt, out = pp2
    dst = folders["pp2"]
    w = model.embed.tok.weight
    for weight, exp_avg in (r["moved"] for r in out):
        assert torch.equal(weight, w.detach()) and torch.equal(exp_avg, opt.state[w]["exp_avg"])
    back, back_opt = _adamw_tied_model()
    torch.nn.init.zeros_(back.embed.tok.weight)
    Checkpointer(dst).load(model=back, optimizer=back_opt)
    v = back.embed.tok.weight
    assert torch.equal(v, w) and torch.equal(back_opt.state[v]["exp_avg"], opt.state[w]["exp_avg"])
