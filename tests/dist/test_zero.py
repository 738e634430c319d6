"""ZeRO stages 0-3 on real gloo ranks against a single-process run and DataParallel.

One world-4 spawn (whose rank pairs {0,1} and {2,3} also run as two world-2 jobs over
process groups) trains every (stage, optimizer) pair and DataParallel on the same data,
resumes from state dicts and from a Checkpointer checkpoint saved at another world
size, accumulates micro-batches with gradient clipping, and measures per-rank
model-state bytes (vs the ZeRO paper's formulas, fp32 variant) and the bytes each stage
sends per step. The parent trains the unsharded reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import disttrain
from disttrain import memory, plan
from disttrain.testing import spawn

STEPS = 3
VOCAB, DIM = 11, 8


class TiedNet(nn.Module):
    """Embedding -> MLP -> LayerNorm -> head tied to the embedding (as nanoGPT), + a root bias."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, DIM))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.bias = nn.Parameter(torch.zeros(VOCAB))

    def forward(self, tokens):  # (B,) -> (B, VOCAB)
        h = self.emb(tokens)
        return self.head(self.norm(h + self.mlp(h))) + self.bias


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return TiedNet()


def factory(name):
    if name == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9)
    return lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1)


def batch(step):  # the global batch of `step`: 16 tokens and targets
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (16,), generator=g), torch.randint(0, VOCAB, (16,), generator=g)


def train(model, opt, steps, rank=0, world=1, start=0):
    for s in range(start, start + steps):
        x, y = batch(s)
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def where(group):
    """(rank, world) inside `group` (None = all ranks)."""
    return dist.get_rank(group), dist.get_world_size(group)


def every_stage(group):
    """State dicts after STEPS for every (optimizer, stage) and for DataParallel."""
    rank, world = where(group)
    out = {}
    for name in ("sgd", "adamw"):
        for stage in range(4):
            z = disttrain.Zero(make_model(), factory(name), stage=stage, group=group,
                               bucket_mb=0.001)
            train(z, z.optimizer, STEPS, rank, world)
            out[f"{name}/zero{stage}"] = z.state_dict()
            with torch.no_grad():  # inference between steps (stage 3 gathers, no hooks)
                out[f"{name}/zero{stage}/eval"] = z(torch.arange(VOCAB))
        dp = disttrain.DataParallel(make_model(), group=group)
        opt = factory(name)(list(dp.parameters()))
        train(dp, opt, STEPS, rank, world)
        out[f"{name}/dp"] = dp.module.state_dict()
    return out


CLIP = 0.5


def accumulate_and_clip(group):
    """Every stage: each step = 2 micro-batches of backward, clip to CLIP, step."""
    rank, world = where(group)
    out = {}
    for stage in range(4):
        z = disttrain.Zero(make_model(), factory("adamw"), stage=stage, group=group,
                           bucket_mb=0.001)
        norms = []
        for s in range(STEPS):
            x, y = batch(s)
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
            z.optimizer.zero_grad()
            for xm, ym in zip(x.chunk(2), y.chunk(2)):
                (nn.functional.cross_entropy(z(xm), ym) / 2).backward()
            norms.append(z.optimizer.clip_grad_norm_(CLIP))
            z.optimizer.step()
        out[stage] = {"sd": z.state_dict(), "norms": torch.stack(norms)}
    return out


def resume_matches_uninterrupted(group):
    """Stage 2 and 3: save after 2 steps, load into fresh wrappers, 1 more step == 3 steps."""
    rank, world = where(group)
    errors = {}
    for stage in (2, 3):
        a = disttrain.Zero(make_model(), factory("adamw"), stage=stage, group=group)
        train(a, a.optimizer, 2, rank, world)
        # NOTE: torch state dicts alias live tensors; clone as saving to disk would
        model_sd, opt_sd = clone(a.state_dict()), clone(a.optimizer.state_dict())
        train(a, a.optimizer, 1, rank, world, start=2)
        b = disttrain.Zero(make_model(), factory("adamw"), stage=stage, group=group)
        b.load_state_dict(model_sd)
        b.optimizer.load_state_dict(opt_sd)
        train(b, b.optimizer, 1, rank, world, start=2)
        sa, sb = a.state_dict(), b.state_dict()
        errors[stage] = max((sa[k] - sb[k]).abs().max().item() for k in sa)
    try:  # an optimizer state saved at stage 3 does not load at stage 2
        b = disttrain.Zero(make_model(), factory("adamw"), stage=2, group=group)
        b.optimizer.load_state_dict(opt_sd)
        errors["mismatch"] = ""
    except ValueError as err:
        errors["mismatch"] = str(err)
    return errors


def checkpoint_across_world_sizes(folder, pair):
    """Save at world 4, stage 1 after 2 steps (disttrain.Checkpointer); load into
    stages 2 and 3 over a group of 2 and take the third step there."""
    rank, world = where(None)
    z = disttrain.Zero(make_model(), factory("adamw"), stage=1)
    train(z, z.optimizer, 2, rank, world)
    disttrain.Checkpointer(folder).save(2, model=z, optimizer=z.optimizer)
    dist.barrier()
    rank, world = where(pair)
    out = {}
    for stage in (2, 3):
        z = disttrain.Zero(make_model(), factory("adamw"), stage=stage, group=pair)
        got = disttrain.Checkpointer(folder, group=pair).load(model=z, optimizer=z.optimizer,
                                                              rng=False)
        assert got == 2, got
        train(z, z.optimizer, 1, rank, world, start=2)
        out[stage] = z.state_dict()
    return out


def zero_with_tensor_parallel():
    """Mesh(dp=2, tp=2): a column/row-parallel MLP, ZeRO (or DataParallel) over dp."""
    from disttrain.parallel.tensor import apply_tp

    mesh = disttrain.Mesh(dp=2, tp=2)
    rank, world = mesh.local_rank("dp"), mesh.size("dp")
    out = {}
    for kind in ("dp", "zero1", "zero3"):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        net = apply_tp(net, mesh, {"0": "colwise", "2": "rowwise"})
        if kind == "dp":
            model = disttrain.DataParallel(net, group=mesh.group("dp"))
            opt = factory("adamw")(list(model.parameters()))
        else:
            model = disttrain.Zero(net, factory("adamw"), stage=int(kind[-1]),
                                   group=mesh.group("dp"))
            opt = model.optimizer
        for s in range(STEPS):
            g = torch.Generator().manual_seed(s)
            x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
            opt.zero_grad()
            nn.functional.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
            opt.step()
        out[kind] = {k: v.clone() for k, v in
                     (model.module if kind == "dp" else model).state_dict().items()}
    return out


def train_everything(folder):
    """One world-4 job; ranks {0,1} and {2,3} are also two independent world-2 ZeRO jobs
    (process groups of 2), so world 2 is covered twice without a second spawn.

    NOTE: one spawn does it all: starting processes dominates this file's test time.
    """
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[dist.get_rank() // 2]
    return {
        4: every_stage(None),
        2: every_stage(pair),
        "resume": resume_matches_uninterrupted(pair),
        "accumulate": accumulate_and_clip(pair),
        "checkpoint": checkpoint_across_world_sizes(folder, pair),
        "measure": measure_stages(),
        "tp": zero_with_tensor_parallel(),
    }


def clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone(v) for v in obj]
    return obj


def ref_model(name):
    model = make_model()
    train(model, factory(name)(list(model.parameters())), STEPS)
    return model


def reference(name):
    return ref_model(name).state_dict()


def assert_close(got, want, what):
    assert got.keys() == want.keys(), what
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=2e-5, rtol=1e-4, msg=f"{what}: {k}")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every rank's train_everything(), computed once for this module's tests."""
    return spawn(train_everything, 4, str(tmp_path_factory.mktemp("zero-ckpt")), timeout=170)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 4])
def test_every_stage_matches_single_process_and_data_parallel(world, results):
    out = [r[world] for r in results]
    for name in ("sgd", "adamw"):
        ref = reference(name)
        for rank in range(4):
            assert_close(out[rank][f"{name}/dp"], ref, f"{name} DataParallel vs single process")
            for stage in range(4):
                key = f"{name}/zero{stage}"
                assert_close(out[rank][key], ref, f"{key} rank {rank} vs single process")
                assert_close(out[rank][key], out[rank][f"{name}/dp"], f"{key} vs DataParallel")
        trained = ref_model(name)
        with torch.no_grad():
            want = trained(torch.arange(VOCAB))
        for rank in range(4):
            for stage in range(4):
                torch.testing.assert_close(out[rank][f"{name}/zero{stage}/eval"], want,
                                           atol=2e-5, rtol=1e-4)
        # the tied head really is the embedding after training
        sd = out[0][f"{name}/zero3"]
        assert torch.equal(sd["head.weight"], sd["emb.weight"])


@pytest.mark.timeout(180)
def test_resume_from_state_dicts_and_refuse_another_layout(results):
    for rank, out in enumerate(results):
        resume = out["resume"]
        assert resume[2] < 1e-6 and resume[3] < 1e-6, (rank, resume)
        assert "different ZeRO layout" in resume["mismatch"] and "stage" in resume["mismatch"]


@pytest.mark.timeout(180)
def test_accumulation_over_micro_batches_and_grad_clipping_match_single_process(
        results):
    model = make_model()
    opt = factory("adamw")(list(model.parameters()))
    norms = []
    for s in range(STEPS):
        x, y = batch(s)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        norms.append(nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        opt.step()
    norms = torch.stack(norms)
    assert (norms > CLIP).all()  # clipping did something
    for rank, out in enumerate(results):
        for stage, got in out["accumulate"].items():
            torch.testing.assert_close(got["norms"], norms, atol=1e-5, rtol=1e-4)
            assert_close(got["sd"], model.state_dict(), f"stage {stage} rank {rank}")


@pytest.mark.timeout(180)
def test_checkpoint_saved_at_world_4_stage_1_resumes_at_world_2_stages_2_and_3(
        results):
    ref = reference("adamw")  # 3 uninterrupted steps
    for rank, out in enumerate(results):
        for stage, sd in out["checkpoint"].items():
            assert_close(sd, ref, f"stage {stage} rank {rank} resumed from checkpoint")


@pytest.mark.timeout(180)
def test_zero_over_the_dp_axis_of_a_tp_mesh_matches_data_parallel(results):
    for rank, out in enumerate(results):
        tp = out["tp"]
        for kind in ("zero1", "zero3"):
            assert_close(tp[kind], tp["dp"], f"{kind} over dp with tp=2, rank {rank}")
    # the two tp ranks of a dp replica hold different shards (TP really happened)
    first = results
    assert not torch.equal(first[0]["tp"]["dp"]["0.weight"], first[1]["tp"]["dp"]["0.weight"])


# ---- memory and communication ------------------------------------------------------

LAYERS, WIDTH = 8, 64


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def measure_stages():
    """Each rank: model-state bytes after a step, and bytes sent in one later step."""
    adamw = factory("adamw")
    out = {}
    for stage in range(4):
        z = disttrain.Zero(make_mlp(), adamw, stage=stage, bucket_mb=0.02)
        x = torch.randn(4, WIDTH)
        for _ in range(2):  # bytes of the second step only
            z.comm_stats.reset()
            z.optimizer.zero_grad()
            z(x).square().mean().backward()
            z.optimizer.step()
        ms = memory.model_state(z)
        out[stage] = {"params": ms.params, "grads": ms.grads, "optimizer": ms.optimizer,
                      "sent": z.comm_stats.total(), "calls": dict(z.comm_stats.calls),
                      "peak": getattr(z.engine, "peak", 0), "stepped": len(z.optimizer.inner.state)}
    dp = disttrain.DataParallel(make_mlp())
    opt = adamw(list(dp.parameters()))
    opt.zero_grad()
    dp(torch.randn(4, WIDTH)).square().mean().backward()
    opt.step()
    ms = memory.model_state(dp, opt)
    out["dp"] = {"params": ms.params, "grads": ms.grads, "optimizer": ms.optimizer,
                 "stepped": len(opt.state)}
    return out


@pytest.mark.timeout(180)
def test_model_state_bytes_match_the_paper_and_stage3_sends_one_and_a_half_times_dp(
        results):
    world = 4
    out = [r["measure"] for r in results]
    psi = sum(p.numel() for p in make_mlp().parameters())
    assert psi % world == 0  # no padding: every byte below is the formula's, exactly
    for rank in range(world):
        for stage in list(range(4)) + ["dp"]:
            got = out[rank][stage]
            want = plan.model_state_bytes(psi, world, 0 if stage == "dp" else stage, "adamw", "fp32")
            # beyond the formula: AdamW's float32 `step` per tensor it steps (ZeRO: one per
            # flat shard, at most one per layer here), and the one-element preemption flag
            # that rides in DataParallel's gradient buckets
            assert 0 < got["stepped"] <= (2 * LAYERS if stage == "dp" else LAYERS), (rank, stage)
            extra = {"params": 0, "grads": 4 if stage == "dp" else 0,
                     "optimizer": 4 * got["stepped"]}
            for part in ("params", "grads", "optimizer"):
                assert got[part] == getattr(want, part) + extra[part], (rank, stage, part)
    # stage 3 shards everything: 16 Psi / N, i.e. a quarter of DP's 16 Psi at world 4
    sent = [out[0][s]["sent"] for s in range(4)]
    ring = (world - 1) / world
    assert sent[0] == 2 * ring * 4 * psi  # allreduce of the fp32 grads
    assert sent[1] == sent[2] == sent[0]  # reduce-scatter + all-gather
    assert sent[3] == 1.5 * sent[0]  # 2 all-gathers + reduce-scatter
    assert out[0][3]["calls"] == {"all_gather": 2 * LAYERS, "reduce_scatter": LAYERS}
    # stage 3 holds at most 2 layers gathered (this one + the prefetched one) and 2 layers'
    # gradients in flight: half of the 8 layers' full parameters at world 4
    assert 0 < out[0][3]["peak"] <= 0.5 * 4 * psi * 1.01
