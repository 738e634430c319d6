"""DataParallel on real gloo processes against a single-process reference and torch DDP.

Every rank function below is module-level (spawn finds it by name). Data are the same
on every rank (a seeded generator); rank r takes rows [r*B/N, (r+1)*B/N) of each global
batch, so a world-N run must equal one process stepping on the whole batch.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import disttrain
from disttrain.testing import spawn

B, D_IN, D_OUT, STEPS = 16, 8, 4, 4


class Net(nn.Module):
    def __init__(self, seed: int, hidden: int = 32, extra_head: bool = False):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.Sequential(nn.Linear(D_IN, hidden), nn.Tanh(),
                                    nn.Linear(hidden, hidden), nn.Tanh(),
                                    nn.Linear(hidden, D_OUT))
        self.head_b = nn.Linear(hidden, D_OUT) if extra_head else None
        self.register_buffer("scale", 1.0 + torch.rand(1))  # differs by seed: checks broadcast

    def forward(self, x, use_b: bool = False):
        if use_b:
            return self.head_b(self.layers[:4](x)) * self.scale
        return self.layers(x) * self.scale


def batches(steps=STEPS, batch=B, seed=123):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, D_IN, generator=g), torch.randn(batch, D_OUT, generator=g))
            for _ in range(steps)]


def shard(t, rank, world):
    n = t.shape[0] // world
    return t[rank * n:(rank + 1) * n]


def make_opt(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def flat(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def reference(opt_name, steps=STEPS, model=None):
    """Single process, whole batch B: what every world size must reproduce."""
    model = model or Net(seed=0)
    opt = make_opt(opt_name, model.parameters())
    for x, y in batches(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return flat(model)


# ---------------------------------------------------------------- rank functions

def rank_train_vs_ddp(opt_name, bucket_mb):
    """Ours and torch DDP side by side from rank 0's init; params after every step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Net(seed=rank)  # NOTE: different init per rank; wrapping must broadcast rank 0's
    own_init = flat(model)
    ours = disttrain.DataParallel(model, bucket_mb=bucket_mb)
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(ours.module))
    opt, ddp_opt = make_opt(opt_name, ours.parameters()), make_opt(opt_name, ddp.parameters())
    per_step = []
    for x, y in batches():
        x, y = shard(x, rank, world), shard(y, rank, world)
        for m, o in ((ours, opt), (ddp, ddp_opt)):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
        per_step.append(flat(ours.module))
    return {"own_init": own_init, "per_step": per_step, "ddp": flat(ddp.module),
            "buffer": ours.module.scale.clone(), "events": ours.last_step_events,
            "num_buckets": ours.num_buckets}


def rank_no_sync(accum):
    """Each global batch split into `accum` micro-batches; all but the last under no_sync."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ours = disttrain.DataParallel(Net(seed=0), bucket_mb=0.001)
    opt = make_opt("adamw", ours.parameters())
    for x, y in batches():
        x, y = shard(x, rank, world), shard(y, rank, world)
        opt.zero_grad()
        for k, (xm, ym) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
            loss = nn.functional.mse_loss(ours(xm), ym) / accum
            if k < accum - 1:
                with ours.no_sync():
                    loss.backward()
            else:
                loss.backward()
        opt.step()
    return flat(ours.module)


def rank_unused_error():
    model = Net(seed=0, extra_head=True)  # head_b never used
    ours = disttrain.DataParallel(model)
    x, y = batches(1)[0]
    try:
        nn.functional.mse_loss(ours(x), y).backward()
    except RuntimeError as err:
        message = str(err)
    else:
        message = None
    # The group must still be usable after the error (launched buckets were waited for).
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"message": message, "after": t}


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("boom in backward")


def rank_backward_error_recovers():
    """A backward that dies half way (after a bucket went out) must not poison the next."""
    import warnings

    rank, world = dist.get_rank(), dist.get_world_size()
    ours = disttrain.DataParallel(Net(seed=0), bucket_mb=0.0005)  # last layer: 2 buckets
    opt = make_opt("sgd", ours.parameters())
    x, y = batches(1)[0]
    x, y = shard(x, rank, world), shard(y, rank, world)
    hook = ours.module.layers[3].register_forward_hook(lambda m, i, o: _FailInBackward.apply(o))
    try:
        nn.functional.mse_loss(ours(x), y).backward()
    except ValueError:
        pass
    launched = [e for e in ours.last_step_events if e[0] == "launch"]
    hook.remove()
    opt.zero_grad()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nn.functional.mse_loss(ours(x), y).backward()
    opt.step()
    return {"launched": len(launched), "warned": any("did not finish" in str(w.message)
                                                     for w in caught),
            "params": flat(ours.module)}


def variant_model(kind):
    model = Net(seed=0)
    if kind == "mixed_dtype":  # two dtypes -> two flat buffers, buckets never mixed
        model.layers[2].double()
        model.layers.insert(2, _Cast(torch.float64))
        model.layers.insert(4, _Cast(torch.float32))
    if kind == "tied":  # one Parameter used twice: one slot, one hook, one gradient
        extra = nn.Linear(32, 32)
        extra.weight = model.layers[2].weight
        model.layers.insert(4, extra)
    return model


class _Cast(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        return x.to(self.dtype)


def variant_steps(model, dp, kind, rank, world):
    """Train `dp` (DataParallel or the plain model) the way `kind` says; flat params."""
    opt = make_opt("sgd", dp.parameters())
    for x, y in batches():
        x, y = shard(x, rank, world), shard(y, rank, world)
        opt.zero_grad(set_to_none=kind != "zero_fill")
        nn.functional.mse_loss(dp(x), y).backward()
        opt.step()
    return torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])


def rank_variant(kind):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = variant_model(kind)
    dp = disttrain.DataParallel(model, bucket_mb=0.001,
                                gradient_as_bucket_view=kind != "no_view")
    return {"params": variant_steps(model, dp, kind, rank, world),
            "buckets": dp.num_buckets}


def rank_bad_input():
    """Each bad argument -> the error message it produced (None if it did not raise)."""
    cases = {
        "bucket_mb": dict(module=Net(0), bucket_mb="big"),
        "bucket_zero": dict(module=Net(0), bucket_mb=0),
        "compression": dict(module=Net(0), compression="int8"),
        "not_module": dict(module=lambda x: x),
        "frozen": dict(module=Net(0).requires_grad_(False)),
    }
    out = {}
    for name, kwargs in cases.items():
        try:
            disttrain.DataParallel(**kwargs)
            out[name] = None
        except (ValueError, TypeError) as err:
            out[name] = str(err)
    return out


def rank_mismatched_usage():
    """Rank 0 uses both heads, rank 1 never uses `head_b`: rank 1 cannot launch the
    bucket rank 0 is waiting on. Each must say why instead of hanging."""
    rank = dist.get_rank()
    ours = disttrain.DataParallel(Net(seed=0, extra_head=True))
    x, y = batches(1)[0]
    try:
        loss = nn.functional.mse_loss(ours(x), y)
        if rank == 0:  # NOTE: not through ours(): a second forward would broadcast buffers
            hidden = ours.module.layers[:4](x)
            loss = loss + nn.functional.mse_loss(ours.module.head_b(hidden), y)
        loss.backward()
    except Exception as err:  # noqa: BLE001 - the message is the result
        return f"{type(err).__name__}: {err}"
    return None


def rank_find_unused():
    """Rank 0 uses head `layers[4]`, rank 1 uses `head_b`; nobody uses `spare`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Net(seed=0, extra_head=True)
    model.spare = nn.Linear(2, 2)
    ours = disttrain.DataParallel(model, find_unused=True, bucket_mb=0.0005)
    opt = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    for x, y in batches():
        x, y = shard(x, rank, world), shard(y, rank, world)
        opt.zero_grad()
        nn.functional.mse_loss(ours(x, use_b=rank == 1), y).backward()
        assert ours.module.spare.weight.grad is None
        opt.step()
    return flat(ours.module)


def reference_find_unused(world):
    model = Net(seed=0, extra_head=True)
    model.spare = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    for x, y in batches():
        opt.zero_grad()
        losses = [nn.functional.mse_loss(model(shard(x, r, world), use_b=r == 1),
                                          shard(y, r, world)) for r in range(world)]
        (sum(losses) / world).backward()
        opt.step()
    return flat(model)


def rank_compressed(compression):
    rank, world = dist.get_rank(), dist.get_world_size()
    ours = disttrain.DataParallel(Net(seed=0), compression=compression, bucket_mb=0.001)
    opt = make_opt("sgd", ours.parameters())
    for x, y in batches():
        opt.zero_grad()
        nn.functional.mse_loss(ours(shard(x, rank, world)), shard(y, rank, world)).backward()
        opt.step()
    return flat(ours.module)


def rank_subgroups():
    """World 4 as two data-parallel groups {0,1} and {2,3}, each on its own data."""
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    ours = disttrain.DataParallel(Net(seed=rank), group=mine, bucket_mb=0.001)
    opt = make_opt("sgd", ours.parameters())
    for x, y in batches(seed=rank // 2):
        sub = dist.get_rank(mine)
        opt.zero_grad()
        nn.functional.mse_loss(ours(shard(x, sub, 2)), shard(y, sub, 2)).backward()
        opt.step()
    return flat(ours.module)


def rank_auto_bucket():
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Net(seed=0, hidden=600)  # ~1.4 MiB of fp32 gradients: two candidate sizes
    ours = disttrain.DataParallel(model, bucket_mb="auto")
    opt = make_opt("sgd", ours.parameters())
    sizes = []
    for x, y in batches(steps=10):
        opt.zero_grad()
        nn.functional.mse_loss(ours(shard(x, rank, world)), shard(y, rank, world)).backward()
        opt.step()
        sizes.append(ours.bucket_mb)
    return {"params": flat(ours.module), "sizes": sizes, "done": ours.tuner.done}


# ---------------------------------------------------------------- one spawn per world

def rank_suite(scenarios):
    """Run several scenarios in one process group (spawning costs seconds on 2 cores).

    A failing scenario returns its traceback instead of sinking the others.
    """
    import traceback

    out = {}
    for key, fn_name, args in scenarios:
        try:
            out[key] = globals()[fn_name](*args)
        except Exception:  # noqa: BLE001 - reported by the test that owns the scenario
            out[key] = {"error": traceback.format_exc()}
    return out


SUITE_2 = [
    ("sgd", "rank_train_vs_ddp", ("sgd", 25)),
    ("adamw", "rank_train_vs_ddp", ("adamw", 0.001)),
    ("no_sync", "rank_no_sync", (2,)),
    ("find_unused", "rank_find_unused", ()),
    ("fp16", "rank_compressed", ("fp16",)),
    ("bf16", "rank_compressed", ("bf16",)),
    ("auto", "rank_auto_bucket", ()),
    ("backward_error", "rank_backward_error_recovers", ()),
    ("bad_input", "rank_bad_input", ()),
    ("zero_fill", "rank_variant", ("zero_fill",)),
    ("no_view", "rank_variant", ("no_view",)),
    ("mixed_dtype", "rank_variant", ("mixed_dtype",)),
    ("tied", "rank_variant", ("tied",)),
    ("unused_error", "rank_unused_error", ()),  # NOTE: last: it exercises the error path
]
SUITE_4 = [
    ("sgd", "rank_train_vs_ddp", ("sgd", 0.001)),
    ("adamw", "rank_train_vs_ddp", ("adamw", 25)),
    ("subgroups", "rank_subgroups", ()),
]


@pytest.fixture(scope="module")
def suite2():
    return spawn(rank_suite, 2, SUITE_2, timeout=150)


@pytest.fixture(scope="module")
def suite4():
    return spawn(rank_suite, 4, SUITE_4, timeout=150)


def results(suite, key):
    per_rank = [ranks[key] for ranks in suite]
    for r, res in enumerate(per_rank):
        if isinstance(res, dict) and "error" in res:
            pytest.fail(f"scenario {key!r} failed on rank {r}:\n{res['error']}")
    return per_rank


# ---------------------------------------------------------------- tests

@pytest.mark.timeout(170)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_matches_single_process_and_ddp(world, opt_name, request):
    out = results(request.getfixturevalue(f"suite{world}"), opt_name)
    init0 = flat(Net(seed=0))
    assert not torch.equal(out[1]["own_init"], init0)  # ranks really started apart
    for r in range(1, world):  # bitwise identical replicas after every step
        for step, (a, b) in enumerate(zip(out[0]["per_step"], out[r]["per_step"])):
            assert torch.equal(a, b), f"rank {r} differs from rank 0 after step {step}"
        assert torch.equal(out[r]["buffer"], out[0]["buffer"])
    expected = reference(opt_name)
    torch.testing.assert_close(out[0]["per_step"][-1], expected)
    torch.testing.assert_close(out[0]["per_step"][-1], out[0]["ddp"])


@pytest.mark.timeout(170)
def test_allreduce_is_launched_during_backward(suite2):
    out = results(suite2, "adamw")[0]  # the run with tiny buckets
    events = out["events"]
    assert out["num_buckets"] >= 3
    launches = [i for i, (kind, _) in enumerate(events) if kind == "launch"]
    grads = [i for i, (kind, _) in enumerate(events) if kind == "grad"]
    end = events.index(("backward_end", -1))
    assert [events[i][1] for i in launches] == list(range(out["num_buckets"]))
    # The first bucket went out while gradients of earlier layers were still coming.
    assert launches[0] < grads[-1] < end
    assert all(kind == "wait" for kind, _ in events[end + 1:])


@pytest.mark.timeout(170)
def test_no_sync_accumulation_equals_large_batch(suite2):
    out = results(suite2, "no_sync")
    assert torch.equal(out[0], out[1])
    torch.testing.assert_close(out[0], reference("adamw"))


@pytest.mark.timeout(170)
def test_unused_parameter_error_names_it(suite2):
    out = results(suite2, "unused_error")
    for r, o in enumerate(out):
        assert o["message"] is not None, f"rank {r} did not raise"
        assert "'head_b.weight'" in o["message"] and f"on rank {r}" in o["message"]
        assert "find_unused=True" in o["message"]
        assert o["after"].item() == 2.0


@pytest.mark.timeout(170)
def test_find_unused_treats_missing_gradients_as_zero(suite2):
    out = results(suite2, "find_unused")
    assert torch.equal(out[0], out[1])
    torch.testing.assert_close(out[0], reference_find_unused(2))


@pytest.mark.timeout(170)
@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_compression_is_close_to_reference(compression, suite2):
    out = results(suite2, compression)
    assert torch.equal(out[0], out[1])
    tol = 2e-3 if compression == "fp16" else 2e-2
    torch.testing.assert_close(out[0], reference("sgd"), rtol=tol, atol=tol)


@pytest.mark.timeout(170)
def test_subgroups_replicate_independently(suite4):
    out = results(suite4, "subgroups")
    assert torch.equal(out[0], out[1]) and torch.equal(out[2], out[3])
    assert not torch.equal(out[0], out[2])
    for group, first in ((0, 0), (1, 2)):  # each group broadcast its own rank 0's init
        model = Net(seed=first)
        opt = make_opt("sgd", model.parameters())
        for x, y in batches(seed=group):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        torch.testing.assert_close(out[first], flat(model))


@pytest.mark.timeout(170)
def test_auto_bucket_size_agrees_across_ranks_and_stays_correct(suite2):
    out = results(suite2, "auto")
    assert out[0]["done"] and out[0]["sizes"] == out[1]["sizes"]
    assert len(set(out[0]["sizes"])) >= 2  # it really tried more than one size
    assert torch.equal(out[0]["params"], out[1]["params"])
    model = Net(seed=0, hidden=600)
    opt = make_opt("sgd", model.parameters())
    for x, y in batches(steps=10):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    torch.testing.assert_close(out[0]["params"], flat(model))


@pytest.mark.timeout(170)
def test_a_failed_backward_does_not_poison_the_next_step(suite2):
    out = results(suite2, "backward_error")
    assert out[0]["launched"] >= 1  # a bucket was in flight when backward died
    assert all(o["warned"] for o in out)
    assert torch.equal(out[0]["params"], out[1]["params"])
    torch.testing.assert_close(out[0]["params"], reference("sgd", steps=1))


@pytest.mark.timeout(170)
def test_bad_arguments_get_clear_errors(suite2):
    out = results(suite2, "bad_input")[0]
    assert "'auto'" in out["bucket_mb"] and "'big'" in out["bucket_mb"]
    assert "> 0" in out["bucket_zero"]
    assert "fp16" in out["compression"]
    assert "nn.Module" in out["not_module"]
    assert "requires grad" in out["frozen"]


@pytest.mark.timeout(170)
@pytest.mark.parametrize("kind", ["zero_fill", "no_view", "mixed_dtype", "tied"])
def test_variants_match_single_process(kind, suite2):
    """zero_grad(set_to_none=False) (accumulate into the bucket), grads not as views,
    parameters of two dtypes, and a parameter used by two layers."""
    out = results(suite2, kind)
    assert torch.equal(out[0]["params"], out[1]["params"])
    model = variant_model(kind)
    expected = variant_steps(model, model, kind, 0, 1)
    torch.testing.assert_close(out[0]["params"], expected)


@pytest.mark.timeout(60)
def test_ranks_using_different_parameters_fail_loudly_not_silently():
    out = spawn(rank_mismatched_usage, 2, collective_timeout=5, timeout=45,
                env={"DISTTRAIN_TIMEOUT": "5"})
    assert all(o is not None for o in out), out
    assert "'head_b.weight' received no gradient" in out[1] and "on rank 1" in out[1]
    assert "all_reduce" in out[0], out[0]
