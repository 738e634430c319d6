"""The default loss under tensor parallelism follows the output layer; float64 stays float64.

A model returning logits is trained one step at tp=2 with its head whole (the plan shards
attention and MLP only: plain cross-entropy) and column-sharded (vocab-parallel
cross-entropy), for disttrain's GPT and a Hugging Face GPT-2 (from a config, no
download), each against one process in float64: loss, gradients, clipped norm and
gradients. Then, in float64: the vocab-parallel loss against F.cross_entropy on the
gathered logits, clip_grad_norm_ at tp=2 x pp=2 and under ZeRO against torch's, and the
pipeline's returned loss on every stage.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import disttrain
from disttrain.mesh import Mesh
from disttrain.models import GPT
from disttrain.testing import spawn
from tests.dist import _gpt_ref as gref

MAX_NORM = 0.05  # below every run's norm: clipping acts
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
TOL = dict(atol=1e-12, rtol=1e-12)
GPT_WHOLE_HEAD = {"attn.qkv": "colwise", "attn.proj": "rowwise", "mlp.fc": "colwise",
                  "mlp.proj": "rowwise"}


class Logits(nn.Module):
    """A Hugging Face causal LM as a user wraps it: token ids -> logits (no labels)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, x):
        return self.lm(x).logits


def _hf_model():
    from tests.dist import _hf_ref

    return Logits(_hf_ref.make_model(tie_word_embeddings=False))


def _gpt_model():
    return gref.make_model().double()


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def one_process(make, x, y):
    """Loss, gradients, clip norm and clipped gradients of one float64 step, unsharded."""
    model = make()
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    grads = _grads(model)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    return loss.detach(), grads, norm, _grads(model)


def parallel(make, x, y, mesh, plan, **kw):
    """The same step under parallelize; rank 0 returns it, with the loss of every rank."""
    pm = disttrain.parallelize(make(), mesh, plan, **kw)
    dp, d = mesh.size("dp"), mesh.local_rank("dp")
    loss = pm.train_step(x.chunk(dp)[d], y.chunk(dp)[d])
    grads = pm.full_state_dict(grads=True)
    norm = pm.clip_grad_norm_(MAX_NORM)
    clipped = pm.full_state_dict(grads=True)
    world = dist.get_world_size()
    losses = [torch.zeros((), dtype=torch.float64) for _ in range(world)]
    dist.all_gather(losses, loss.to(torch.float64))
    codes = [torch.zeros((), dtype=torch.int64) for _ in range(world)]
    dist.all_gather(codes, torch.tensor(DTYPES.index(loss.dtype)))
    dtypes = [str(DTYPES[int(c)]) for c in codes]  # the returned loss's dtype, by rank
    return (loss, grads, norm, clipped, losses, dtypes) if disttrain.rank() == 0 else None


def assert_same(out, ref, what):
    loss, grads, norm, clipped = out[:4]
    ref_loss, ref_grads, ref_norm, ref_clipped = ref
    assert loss.dtype == norm.dtype == torch.float64, (what, loss.dtype, norm.dtype)
    torch.testing.assert_close(loss, ref_loss, **TOL, msg=lambda m: f"{what} loss: {m}")
    torch.testing.assert_close(norm, ref_norm, **TOL, msg=lambda m: f"{what} norm: {m}")
    assert grads.keys() == ref_grads.keys(), what
    for name in ref_grads:
        for got, want, kind in ((grads, ref_grads, "grad"), (clipped, ref_clipped, "clipped")):
            torch.testing.assert_close(got[name], want[name], **TOL,
                                       msg=lambda m, n=name, k=kind: f"{what} {k} {n}: {m}")
    assert all(v == loss.item() for v in (t.item() for t in out[4])), (what, out[4])


def default_loss_both_heads():
    """GPT and Hugging Face GPT-2 at tp=2, head whole then column-sharded."""
    from disttrain.parallel.tensor import TPPlan, gpt2_plan
    from tests.dist import _hf_ref

    mesh = Mesh(tp=2)
    hf = gpt2_plan()
    runs = {
        "gpt whole head": (_gpt_model, gref.make_batch(), GPT_WHOLE_HEAD),
        "gpt sharded head": (_gpt_model, gref.make_batch(),
                             {**GPT_WHOLE_HEAD, "head.lm_head": "colwise"}),
        "hf whole head": (_hf_model, _hf_ref.make_batch(), hf),
        "hf sharded head": (_hf_model, _hf_ref.make_batch(),
                            TPPlan({**hf.styles, "lm_head": "colwise"}, hf.adjust)),
    }
    for what, (make, (x, y), plan) in runs.items():
        expected = one_process(make, x, y)
        out = parallel(make, x, y, mesh, plan)
        if disttrain.rank() == 0:
            assert_same(out, expected, what)
    return True


def undecidable_plans_are_refused():
    """A model computing its own loss with a sharded head; a plan the code cannot read."""
    from disttrain.parallel.tensor import TPPlan, gpt2_plan
    from tests.dist import _hf_ref

    mesh, hf = Mesh(tp=2), gpt2_plan()
    sharded = TPPlan({**hf.styles, "lm_head": "colwise"}, hf.adjust)
    with pytest.raises(ValueError, match=r"computes its own loss from labels=.*'lm_head'.*"
                                         r"loss_fn=disttrain.token_loss\(mesh.group\('tp'\)\)"):
        disttrain.parallelize(_hf_ref.make_model(tie_word_embeddings=False), mesh, sharded)

    class Net(nn.Module):  # no get_output_embeddings: only the plan can tell
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb, self.fc, self.proj = nn.Embedding(8, 4), nn.Linear(4, 8), nn.Linear(8, 4)
            self.out = nn.Linear(4, 8)

        def forward(self, x):
            return self.out(self.proj(torch.tanh(self.fc(self.emb(x)))))

    mlp = {"fc": "colwise", "proj": "rowwise"}
    with pytest.raises(ValueError, match=r"cannot tell whether Net's output.*'out'.*loss_fn="):
        disttrain.parallelize(Net().double(), mesh, {**mlp, "out": "colwise"})
    x, y = torch.randint(8, (4, 3)), torch.randint(8, (4, 3))
    logits = Net().double()(x)
    want = F.cross_entropy(logits.reshape(-1, 8), y.reshape(-1))
    got = disttrain.parallelize(Net().double(), mesh, mlp).train_step(x, y)  # head whole
    torch.testing.assert_close(got, want.detach(), **TOL)
    return True


def vocab_parallel_loss_keeps_dtype():
    """float64 logits sharded over tp=2 against F.cross_entropy on the whole; bf16 upcast."""
    from disttrain.parallel.tensor import vocab_parallel_cross_entropy

    group, rank = dist.group.WORLD, dist.get_rank()
    g = torch.Generator().manual_seed(3)
    full = torch.randn(6, 10, generator=g, dtype=torch.float64) * 4
    y = torch.randint(10, (6,), generator=g)
    whole = full.clone().requires_grad_()
    want = F.cross_entropy(whole, y)
    want.backward()
    shard = full.chunk(2, dim=-1)[rank].clone().requires_grad_()
    got = vocab_parallel_cross_entropy(shard, y, group)
    got.backward()
    assert got.dtype == shard.grad.dtype == torch.float64, (got.dtype, shard.grad.dtype)
    torch.testing.assert_close(got, want.detach(), **TOL)
    torch.testing.assert_close(shard.grad, whole.grad.chunk(2, dim=-1)[rank], **TOL)
    half = full.chunk(2, dim=-1)[rank].to(torch.bfloat16).requires_grad_()
    low = vocab_parallel_cross_entropy(half, y, group)
    low.backward()
    assert low.dtype == torch.float32 and half.grad.dtype == torch.bfloat16
    ref = F.cross_entropy(full.to(torch.bfloat16).float(), y)
    torch.testing.assert_close(low, ref, atol=1e-5, rtol=1e-5)
    return True


def two_ranks():
    # NOTE: one spawn for all: starting processes costs more than the checks
    return (vocab_parallel_loss_keeps_dtype() and undecidable_plans_are_refused()
            and default_loss_both_heads())


@pytest.mark.timeout(150)
def test_default_loss_follows_the_head_and_float64_stays_float64_at_tp2():
    assert spawn(two_ranks, 2, timeout=140) == [True, True]


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def four_ranks():
    """tp=2 x pp=2 (loss on every stage, clip) and dp=2 x tp=2 under ZeRO 2 (its clip),
    then ZeRO 1-3 over the 4 ranks: the optimizer's own clip_grad_norm_. float64."""
    x, y = gref.make_batch()
    expected = one_process(_gpt_model, x, y)
    for mesh, kw in ((Mesh(pp=2, tp=2), dict(microbatches=2)),
                     (Mesh(dp=2, tp=2), dict(zero=2, optimizer_factory=_sgd))):
        out = parallel(_gpt_model, x, y, mesh, GPT.tp_plan, **kw)
        if disttrain.rank() == 0:
            assert out[5] == ["torch.float64"] * 4, out[5]  # every stage: the model's dtype
            assert_same(out, expected, f"{mesh.shape} {kw}")
    xs, ys = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
        ref_norm, ref_params = _zero_reference(net, xs, ys)
        z = disttrain.Zero(net, _sgd, stage=stage)
        r = dist.get_rank()
        F.mse_loss(z(xs.chunk(4)[r]), ys.chunk(4)[r]).backward()
        norm = z.optimizer.clip_grad_norm_(MAX_NORM)
        z.optimizer.step()  # SGD: the parameters now show the clipped gradients
        params = z.fp32_state_dict()
        assert norm.dtype == torch.float64, (stage, norm.dtype)
        torch.testing.assert_close(norm, ref_norm, **TOL, msg=lambda m, s=stage: f"ZeRO {s}: {m}")
        for name, p in ref_params.items():
            torch.testing.assert_close(params[name], p, **TOL,
                                       msg=lambda m, s=stage, n=name: f"ZeRO {s} {n}: {m}")
    return True


def _zero_reference(net, x, y):
    """torch's clip_grad_norm_ and one SGD step of an unsharded copy on the mean loss of
    the 4 ranks' parts: (norm, parameters)."""
    import copy

    ref = copy.deepcopy(net)
    sum(F.mse_loss(ref(a), b) for a, b in zip(x.chunk(4), y.chunk(4))).div(4).backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
    _sgd(list(ref.parameters())).step()
    return norm, {n: p.detach() for n, p in ref.named_parameters()}


@pytest.mark.timeout(150)
def test_float64_clip_and_pipeline_loss_at_tp2_pp2_and_zero():
    assert spawn(four_ranks, 4, timeout=140) == [True] * 4
