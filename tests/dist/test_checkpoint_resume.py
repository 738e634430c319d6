"""Exact resume on real gloo processes: 2k steps straight == k steps, save, fresh processes
load, k more steps, bitwise. Dropout makes the RNG matter; a shuffling shard_loader makes
the data position matter; the save falls in the middle of an epoch.
"""

import pytest
import torch
from torch import nn

import disttrain
from disttrain.testing import spawn

N, D, GLOBAL_BATCH, K = 24, 6, 4, 9  # 6 steps per epoch: step 9 is mid-epoch 1


def _setup(seed: int):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))
    model = disttrain.DataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    data = list(zip(torch.randn(N, D, generator=g), torch.randint(0, 2, (N,), generator=g)))
    # NOTE: DataLoader draws its base seed from the global RNG at each iter() unless it has
    # its own generator; a resumed run starts one more iterator than a straight run.
    loader = disttrain.data.shard_loader(data, GLOBAL_BATCH, seed=3, generator=torch.Generator())
    return model, opt, loader


def _train(model, opt, loader, steps: int) -> None:
    done = 0
    while done < steps:
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            done += 1
            if done == steps:
                return


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def straight_then_first_half(folder: str):
    model, opt, loader = _setup(seed=0)
    _train(model, opt, loader, 2 * K)
    straight = _flat(model)
    model, opt, loader = _setup(seed=0)
    _train(model, opt, loader, K)
    disttrain.Checkpointer(folder).save(K, model=model, optimizer=opt, loader=loader)
    return {"straight": straight, "position": loader.state_dict()}


def resume_second_half(folder: str):
    model, opt, loader = _setup(seed=42)  # different init: the load must override it
    torch.manual_seed(1000 + disttrain.rank())  # and a different RNG stream
    step = disttrain.Checkpointer(folder).load(model=model, optimizer=opt, loader=loader)
    position = loader.state_dict()
    _train(model, opt, loader, 2 * K - step)
    return {"step": step, "resumed": _flat(model), "position": position}


@pytest.mark.timeout(90)
def test_resume_at_world_two_is_bitwise_equal_to_straight_run(tmp_path):
    first = spawn(straight_then_first_half, 2, str(tmp_path), timeout=60)
    second = spawn(resume_second_half, 2, str(tmp_path), timeout=60)
    assert first[0]["position"] == {"epoch": 1, "offset": 12}
    for r in range(2):
        assert second[r]["step"] == K
        assert second[r]["position"] == first[r]["position"]
        assert torch.equal(second[r]["resumed"], first[r]["straight"]), f"rank {r} differs"
    assert not torch.equal(first[0]["straight"], first[1]["straight"] * 0)
