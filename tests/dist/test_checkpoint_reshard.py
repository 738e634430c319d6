"""Checkpoints load into other layouts, on real gloo processes.

1. Plain data parallel: saved by 4 DataParallel ranks (replicated: written once, by
   rank 0), loaded by 2 ranks and by 1 plain process: identical parameters and AdamW state.
2. Pipeline stages: 4 ranks each hold one layer of a 4-layer model (plain state_dict,
   different keys per rank); loaded as 2 stages of 2 layers, and whole on 1 rank.
3. Sharded state: a toy strategy holds a weight and its optimizer moment as row slices
   (10 rows over 4 ranks: 3, 3, 2, 2) through `sharded_state_dict()`; loaded whole on 1
   rank and resliced on 2 (5, 5), it holds exactly the right rows.
"""

import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import disttrain
from disttrain.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointMismatchError,
    ShardedTensor,
    cli,
    even_slice,
    shard_of,
)
from disttrain.testing import spawn

ROWS, COLS = 10, 3


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))


def _opt_state(opt) -> dict[str, torch.Tensor]:
    return {f"{i}.{k}": v.clone() for i, s in opt.state_dict()["state"].items()
            for k, v in s.items()}


def _full(seed: int) -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(seed))


class RowSharded:
    """A toy sharded strategy: `weight` and its `moment` are cut by rows over ranks."""

    def __init__(self, weight: torch.Tensor, moment: torch.Tensor):
        rank, world = disttrain.rank(), disttrain.world_size()
        self.weight = shard_of(weight, rank, world).local.clone()
        self.moment = shard_of(moment, rank, world).local.clone()
        self.bias = torch.zeros(COLS)  # replicated
        self.steps = 0

    def sharded_state_dict(self):
        rank, world = disttrain.rank(), disttrain.world_size()
        offsets = even_slice((ROWS, COLS), rank, world).offsets
        return {"weight": ShardedTensor(self.weight, (ROWS, COLS), offsets),
                "moment": ShardedTensor(self.moment, (ROWS, COLS), offsets),
                "bias": self.bias, "steps": self.steps}

    def load_sharded_state_dict(self, sd) -> None:
        self.steps = sd["steps"]  # tensors were filled in place already


def _stage(world: int) -> nn.Module:
    """Pipeline stage `rank` of a 4-layer model cut into `world` stages; the layers of other
    stages are Identity, so state_dict keys are the full model's names ("2.weight")."""
    per = 4 // world
    torch.manual_seed(3)
    full = [nn.Linear(3, 3) for _ in range(4)]
    mine = range(disttrain.rank() * per, (disttrain.rank() + 1) * per)
    return nn.Sequential(*(full[i] if i in mine else nn.Identity() for i in range(4)))


def save_at_world_four(plain_dir: str, sharded_dir: str):
    model = disttrain.DataParallel(_net(seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(disttrain.rank())
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 5, generator=g)).pow(2).sum().backward()
        opt.step()
    Checkpointer(plain_dir).save(2, model=model, optimizer=opt, extra={"note": "w4"})
    strategy = RowSharded(_full(1), _full(2))
    strategy.bias += 1.5
    strategy.steps = 7
    Checkpointer(sharded_dir).save(7, model=strategy)
    Checkpointer(os.path.join(sharded_dir, "pp")).save(1, model=_stage(4))
    params = [p.detach().clone() for p in model.parameters()]
    return {"params": params, "opt": _opt_state(opt), "files": sorted(os.listdir(
        os.path.join(plain_dir, "step_00000002")))}


def load_at_world_two(plain_dir: str, sharded_dir: str):
    model = disttrain.DataParallel(_net(seed=5))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ckpt = Checkpointer(plain_dir)
    step = ckpt.load(model=model, optimizer=opt)
    strategy = RowSharded(torch.zeros(ROWS, COLS), torch.zeros(ROWS, COLS))
    sharded_step = Checkpointer(sharded_dir).load(model=strategy)
    stage = _stage(2)
    for p in stage.parameters():
        p.data.zero_()
    Checkpointer(os.path.join(sharded_dir, "pp")).load(model=stage)
    dist.barrier()
    errors = []
    for kwargs in ({"step": 3 + disttrain.rank()}, {"step": 3, "extra": {"x": object()}
                                                    if disttrain.rank() == 1 else {}}):
        try:  # bad input on one rank: every rank raises, none hangs
            Checkpointer(os.path.join(plain_dir, "bad")).save(model=model, **kwargs)
        except (CheckpointError, TypeError) as err:
            errors.append(f"{type(err).__name__}: {err}")
    torch.manual_seed(disttrain.rank())  # a "replicated" layer that differs per rank
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Checkpointer(os.path.join(plain_dir, "differ")).save(1, model=nn.Linear(2, 2))
    errors.append(" | ".join(str(w.message) for w in caught))
    return {"step": step, "errors": errors, "params": [p.detach().clone() for p in model.parameters()],
            "opt": _opt_state(opt), "extra": ckpt.extra, "sharded_step": sharded_step,
            "weight": strategy.weight, "moment": strategy.moment, "bias": strategy.bias,
            "steps": strategy.steps, "stage": stage.state_dict()}


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.timeout(120)
def test_world_four_loads_at_two_and_one(tmp_path, capsys):
    plain, sharded = str(tmp_path / "plain"), str(tmp_path / "sharded")
    saved = spawn(save_at_world_four, 4, plain, sharded, timeout=80)
    # Replicated state is written once (rank 0); each rank writes only its RNG row.
    assert saved[0]["files"] == ["manifest.json"] + [f"rank0000{r}.safetensors" for r in range(4)]
    assert all(_same(s["params"], saved[0]["params"]) for s in saved)
    ref_params, ref_opt = saved[0]["params"], saved[0]["opt"]
    text = _inspect(sharded, capsys)
    assert "saved by 4 rank(s)" in text and "checksums: all ok" in text
    assert "model/weight  float32   [10, 3]        4 pieces along dim 0" in text
    assert "model/bias    float32   [3]            whole" in text
    assert "rng/torch     uint8     [4, 5056]      4 pieces along dim 0" in text

    loaded = spawn(load_at_world_two, 2, plain, sharded, timeout=80)
    torch.manual_seed(3)
    full_model = nn.Sequential(*(nn.Linear(3, 3) for _ in range(4)))  # same init as _stage
    for r, out in enumerate(loaded):
        assert out["step"] == 2 and out["extra"] == {"note": "w4"}
        assert "different steps [3, 4]" in out["errors"][0]
        assert out["errors"][1].startswith("TypeError" if r == 1 else "CheckpointError")
        assert ("" if r == 1 else "rank 1: ") + "extra/x: cannot checkpoint" in out["errors"][1]
        differ = "differ between ranks (tensor: ranks whose copy differs from the first holder's): "
        assert (differ + "{'model/bias': [1], 'model/weight': [1]}" in out["errors"][2]) == (r == 0)
        assert _same(out["params"], ref_params), f"rank {r} params"
        assert out["opt"].keys() == ref_opt.keys()
        assert all(torch.equal(out["opt"][k], ref_opt[k]) for k in ref_opt), f"rank {r} opt"
        rows = even_slice((ROWS, COLS), r, 2).index()
        assert out["sharded_step"] == 7 and out["steps"] == 7
        assert torch.equal(out["weight"], _full(1)[rows]) and out["weight"].shape[0] == 5
        assert torch.equal(out["moment"], _full(2)[rows])
        assert torch.equal(out["bias"], torch.full((COLS,), 1.5))
        # Pipeline 4 stages -> 2: each rank holds (and got) layers 2r and 2r+1.
        assert sorted(out["stage"]) == [f"{i}.{k}" for i in (2 * r, 2 * r + 1)
                                        for k in ("bias", "weight")]
        assert all(torch.equal(v, full_model.state_dict()[k]) for k, v in out["stage"].items())

    # World of one, no process group, plain (unwrapped) model: the same state.
    model = _net(seed=9)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    assert Checkpointer(plain).load(model=model, optimizer=opt) == 2
    assert _same([p.detach() for p in model.parameters()], ref_params)
    assert all(torch.equal(_opt_state(opt)[k], ref_opt[k]) for k in ref_opt)
    whole = RowSharded(torch.zeros(ROWS, COLS), torch.zeros(ROWS, COLS))
    assert Checkpointer(sharded).load(model=whole) == 7
    assert torch.equal(whole.weight, _full(1)) and torch.equal(whole.moment, _full(2))
    reference = {k: v.clone() for k, v in full_model.state_dict().items()}
    for p in full_model.parameters():
        p.data.zero_()
    assert Checkpointer(os.path.join(sharded, "pp")).load(model=full_model) == 1  # pp 4 -> 1
    assert all(torch.equal(v, reference[k]) for k, v in full_model.state_dict().items())
    with pytest.raises(CheckpointMismatchError, match=r"missing keys .*\['4.bias', '4.weight'\]"):
        Checkpointer(os.path.join(sharded, "pp")).load(
            model=nn.Sequential(*(nn.Linear(3, 3) for _ in range(5))))


def _inspect(folder: str, capsys) -> str:
    assert cli.main(["inspect", folder]) == 0
    return capsys.readouterr().out
