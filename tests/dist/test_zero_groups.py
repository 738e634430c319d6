"""ZeRO per-parameter optimizer groups on real gloo ranks (world 2), against torch AdamW.

Both ways of declaring groups (a function of (name, param), a list of names per group)
train at stages 0-3 and must equal one process's torch AdamW over the same groups; no
flat shard mixes two groups; a Checkpointer save restores each group's options into an
optimizer built with other defaults; and groups compose with bf16 (a group at lr 0
leaves its bf16 parameters untouched).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import disttrain
from disttrain.testing import spawn

WORLD, STEPS, VOCAB = 2, 3, 11


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.fc = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, tokens):  # (B,) -> (B, VOCAB)
        return self.head(self.norm(torch.tanh(self.fc(self.emb(tokens)))))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def no_decay(name, p):  # the usual GPT recipe: no weight decay on biases and norms
    return {"weight_decay": 0.0} if p.ndim == 1 else {}


BY_NAME = [{"params": ["head.weight", "head.bias"], "lr": 0.01},
           {"params": ["norm.weight", "norm.bias", "fc.bias"], "weight_decay": 0.0}]
SPECS = {"function": no_decay, "list": BY_NAME}


def adamw(groups, lr=0.05):
    return torch.optim.AdamW(groups, lr=lr, weight_decay=0.1)


def batch(step):
    g = torch.Generator().manual_seed(7 + step)
    return torch.randint(0, VOCAB, (16,), generator=g), torch.randint(0, VOCAB, (16,), generator=g)


def train(model, opt, steps, rank=0, world=1):
    for s in range(steps):
        x, y = batch(s)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x.chunk(world)[rank]).float(),
                                    y.chunk(world)[rank]).backward()
        opt.step()


def _names_groups(z):
    """{name: [group of each flat shard holding it]} (one shard, one group)."""
    out: dict = {}
    for gi, (_, _, members) in zip(z.engine.shard_groups(), z.engine.segments()):
        for pid, _, _ in members:
            out.setdefault(z.param_names[pid], []).append(gi)
    return out


def run_all(folder):
    rank = dist.get_rank()
    out = {}
    for kind, spec in SPECS.items():
        for stage in range(4):
            # NOTE: one 25 MiB bucket would hold every parameter if groups could share one
            z = disttrain.Zero(make_model(), adamw, stage=stage, param_groups=spec)
            train(z, z.optimizer, STEPS, rank, WORLD)
            opts = [{k: v for k, v in g.items() if k != "params"} for g in z.optimizer.param_groups]
            out[kind, stage] = {"sd": z.state_dict(), "groups": _names_groups(z), "options": opts}
    z = disttrain.Zero(make_model(), adamw, stage=2, param_groups=BY_NAME, bucket_mb=0.0005)
    train(z, z.optimizer, 2, rank, WORLD)
    disttrain.Checkpointer(folder).save(2, model=z, optimizer=z.optimizer)
    other = disttrain.Zero(make_model(), lambda gs: adamw(gs, lr=0.5), stage=3,
                           param_groups=BY_NAME)
    before = [g["lr"] for g in other.optimizer.param_groups]
    disttrain.Checkpointer(folder).load(model=other, optimizer=other.optimizer, rng=False)
    out["checkpoint"] = {"before": before, "after": [g["lr"] for g in other.optimizer.param_groups],
                         "wd": [g["weight_decay"] for g in other.optimizer.param_groups]}
    z = disttrain.Zero(make_model(), adamw, stage=3, precision="bf16",
                       param_groups=[{"params": ["fc.weight", "fc.bias"], "lr": 0.0}])
    start = {k: v.clone() for k, v in z.state_dict().items()}
    train(z, z.optimizer, 2, rank, WORLD)
    end = z.state_dict()
    out["bf16"] = {k: bool(torch.equal(start[k], end[k])) for k in start}
    return out


def reference(spec):
    model = make_model()
    named = list(model.named_parameters())
    if callable(spec):
        groups: dict = {}
        for n, p in named:
            opts = spec(n, p)
            groups.setdefault(tuple(sorted(opts.items())), []).append(p)
        param_groups = [{"params": ps, **dict(k)} for k, ps in groups.items()]
    else:
        by_name = dict(named)
        listed = {n for g in spec for n in g["params"]}
        param_groups = [{**g, "params": [by_name[n] for n in g["params"]]} for g in spec]
        param_groups.append({"params": [p for n, p in named if n not in listed]})
    opt = adamw(param_groups)
    train(model, opt, STEPS)
    return model.state_dict(), opt


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every rank's run_all(), computed once for this module's tests."""
    return spawn(run_all, WORLD, str(tmp_path_factory.mktemp("zero-groups-ckpt")), timeout=150)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["function", "list"])
def test_groups_equal_torch_adamw_with_the_same_groups_at_every_stage(kind, results):
    out = results
    want, opt = reference(SPECS[kind])
    want_opts = sorted(str({k: v for k, v in g.items() if k != "params"})
                       for g in opt.param_groups)
    for stage in range(4):
        for rank in range(WORLD):
            got = out[rank][kind, stage]
            assert sorted(map(str, got["options"])) == want_opts, (stage, rank)
            for k in want:
                torch.testing.assert_close(got["sd"][k], want[k], atol=2e-5, rtol=1e-4,
                                           msg=f"{kind} stage {stage}: {k}")
    # every flat shard holding a parameter belongs to that parameter's group: no shard
    # mixes groups (a mixed shard would put one of its parameters in the wrong group)
    for stage in range(4):
        groups = {n: set(gs) for n, gs in out[0][kind, stage]["groups"].items()}
        assert all(len(gs) == 1 for gs in groups.values()), (stage, groups)
        g = {n: gs.pop() for n, gs in groups.items()}
        if kind == "list":
            assert g["head.weight"] == g["head.bias"] == 0, stage
            assert g["norm.weight"] == g["norm.bias"] == g["fc.bias"] == 1, stage
            assert g["emb.weight"] == g["fc.weight"] == 2, stage
        else:
            assert g["fc.bias"] == g["norm.weight"] == g["head.bias"] != g["fc.weight"], stage


@pytest.mark.timeout(180)
def test_group_options_survive_a_checkpoint_and_groups_compose_with_bf16(results):
    out = results
    for rank in range(WORLD):
        ck = out[rank]["checkpoint"]
        assert ck["before"] == [0.01, 0.5, 0.5]  # the new factory's default lr
        assert ck["after"] == [0.01, 0.05, 0.05]  # the saved options
        assert ck["wd"] == [0.1, 0.0, 0.1]
        unchanged = out[rank]["bf16"]
        assert unchanged["fc.weight"] and unchanged["fc.bias"]  # the lr 0 group
        assert not unchanged["head.weight"] and not unchanged["emb.weight"]
