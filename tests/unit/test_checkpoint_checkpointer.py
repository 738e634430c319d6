"""Checkpointer in one process (a world of one): round trip, keep, corruption, mismatch."""

import json
import os
import random

import numpy as np
import pytest
import torch
from torch import nn

from disttrain.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointWarning,
    CorruptCheckpointError,
)


def _net(hidden=8):
    return nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Dropout(0.2), nn.Linear(hidden, 2))


def _train(model, opt, steps, seed=None):
    if seed is not None:
        torch.manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 4)).pow(2).mean().backward()
        opt.step()


def _fresh(seed=0):
    torch.manual_seed(seed)
    model = _net()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


class _Wrapper(nn.Module):
    """What DataParallel looks like to the checkpointer: a module under `.module`."""

    def __init__(self, module):
        super().__init__()
        self.module = module


@pytest.mark.timeout(20)
def test_resume_continues_bitwise(tmp_path):
    model, opt = _fresh()
    _train(model, opt, 3, seed=1)
    ckpt = Checkpointer(tmp_path)
    random.seed(7)
    np.random.seed(7)
    ckpt.save(3, model=model, optimizer=opt, extra={"best": 0.5, "hist": torch.arange(4)})
    _train(model, opt, 4)  # straight run: draws continue from the saved RNG state
    after = (_params(model), random.random(), np.random.rand())

    model2, opt2 = _fresh(seed=99)
    torch.manual_seed(1234)
    random.seed(1)
    extra = {}
    assert Checkpointer(tmp_path).load(model=_Wrapper(model2), optimizer=opt2, extra=extra) == 3
    assert extra["best"] == 0.5 and torch.equal(extra["hist"], torch.arange(4))
    _train(model2, opt2, 4)
    for a, b in zip(after[0], _params(model2)):
        assert torch.equal(a, b)
    assert (random.random(), np.random.rand()) == after[1:]


@pytest.mark.timeout(20)
def test_empty_folder_loads_nothing(tmp_path):
    model, opt = _fresh()
    before = _params(model)
    assert Checkpointer(tmp_path / "none").load(model=model, optimizer=opt) == 0
    assert all(torch.equal(a, b) for a, b in zip(before, _params(model)))


@pytest.mark.timeout(20)
def test_keeps_newest_and_points_latest(tmp_path):
    model, opt = _fresh()
    ckpt = Checkpointer(tmp_path, keep=2)
    for step in (10, 20, 30):
        ckpt.save(step, model=model, optimizer=opt)
    assert ckpt.steps() == [30, 20]
    assert (tmp_path / "latest").read_text().strip() == "step_00000030"
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000020", "step_00000030"]
    ckpt.save(30, model=model)  # re-saving a step replaces it
    assert ckpt.steps() == [30, 20]


@pytest.mark.timeout(20)
def test_restarting_at_an_earlier_step_makes_old_higher_steps_stale(tmp_path):
    model = nn.Linear(2, 2)
    ckpt = Checkpointer(tmp_path, keep=3)
    for step in (100, 5, 6):  # a new run in the same folder
        ckpt.save(step, model=model)
    assert ckpt.steps() == [6, 5, 100]  # load tries 6, then 5; 100 is from the old run
    ckpt.save(7, model=model)
    assert ckpt.steps() == [7, 6, 5]  # the stale step is pruned first
    (tmp_path / "latest").write_text("garbage")
    assert ckpt.steps() == [7, 6, 5]


def _save_steps(tmp_path, steps):
    model, opt = _fresh()
    ckpt = Checkpointer(tmp_path)
    saved = {}
    for step in steps:
        _train(model, opt, 1)
        ckpt.save(step, model=model, optimizer=opt)
        saved[step] = _params(model)
    return saved


def _flip_byte(path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.timeout(20)
@pytest.mark.parametrize("damage", ["bitflip", "truncate", "delete", "manifest", "manifest-value"])
def test_damaged_latest_falls_back_and_names_the_file(tmp_path, damage):
    saved = _save_steps(tmp_path, [1, 2])
    folder = tmp_path / "step_00000002"
    data_file = folder / "rank00000.safetensors"
    if damage == "bitflip":
        _flip_byte(data_file, data_file.stat().st_size - 3)
    elif damage == "truncate":
        data_file.write_bytes(data_file.read_bytes()[:100])
    elif damage == "delete":
        data_file.unlink()
    elif damage == "manifest":
        (folder / "manifest.json").write_text('{"format": "disttrain-checkpoint", "vers')
    else:  # still valid JSON, one hyperparameter changed: only the checksum sees it
        text = (folder / "manifest.json").read_text()
        assert text.count('"lr":0.01,') == 1
        (folder / "manifest.json").write_text(text.replace('"lr":0.01,', '"lr":0.03,'))
    model, opt = _fresh(seed=5)
    with pytest.warns(CheckpointWarning) as caught:
        assert Checkpointer(tmp_path).load(model=model, optimizer=opt) == 1
    message = str(caught[0].message)
    assert "step_00000002" in message and "falling back to step_00000001" in message
    named = "manifest.json" if damage.startswith("manifest") else "rank00000.safetensors"
    assert named in message
    assert all(torch.equal(a, b) for a, b in zip(saved[1], _params(model)))


@pytest.mark.timeout(20)
def test_load_a_chosen_step(tmp_path):
    saved = _save_steps(tmp_path, [1, 2, 3])
    model, opt = _fresh(seed=5)
    assert Checkpointer(tmp_path).load(model=model, optimizer=opt, step=2) == 2
    assert all(torch.equal(a, b) for a, b in zip(saved[2], _params(model)))
    with pytest.raises(CheckpointError, match="no checkpoint of step 7"):
        Checkpointer(tmp_path).load(model=model, step=7)
    _flip_byte(tmp_path / "step_00000002" / "rank00000.safetensors", 150)
    with pytest.warns(CheckpointWarning), pytest.raises(CorruptCheckpointError):
        Checkpointer(tmp_path).load(model=model, step=2)  # no silent fallback to step 1


@pytest.mark.timeout(20)
def test_all_damaged_raises_instead_of_starting_over(tmp_path):
    _save_steps(tmp_path, [1])
    _flip_byte(tmp_path / "step_00000001" / "rank00000.safetensors", 200)
    model, _ = _fresh()
    with pytest.warns(CheckpointWarning), pytest.raises(CorruptCheckpointError, match="SHA-256"):
        Checkpointer(tmp_path).load(model=model)


@pytest.mark.timeout(20)
def test_other_model_names_the_keys(tmp_path):
    model, opt = _fresh()
    Checkpointer(tmp_path).save(1, model=model, optimizer=opt)
    other = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(CheckpointMismatchError) as err:
        Checkpointer(tmp_path).load(model=other)
    text = str(err.value)
    assert "missing keys" in text and "['2.bias', '2.weight']" in text
    assert "unexpected keys" in text and "['3.bias', '3.weight']" in text
    wider = _net(hidden=16)
    with pytest.raises(CheckpointMismatchError, match=r"0.weight: checkpoint \[8, 4\], model \[16, 4\]"):
        Checkpointer(tmp_path).load(model=wider)
    with pytest.raises(CheckpointMismatchError, match="parameter groups hold"):
        Checkpointer(tmp_path).load(optimizer=torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1))


@pytest.mark.timeout(20)
def test_manifest_is_json_with_checksums_and_no_pickle(tmp_path):
    model, opt = _fresh()
    folder = Checkpointer(tmp_path).save(5, model=model, optimizer=opt)
    manifest = json.loads((tmp_path / "step_00000005" / "manifest.json").read_text())
    assert manifest["step"] == 5 and manifest["world_size"] == 1
    assert set(manifest["files"]) == {"rank00000.safetensors"}
    assert len(manifest["files"]["rank00000.safetensors"]["sha256"]) == 64
    assert manifest["tensors"]["model/0.weight"]["global_shape"] == [8, 4]
    assert manifest["tensors"]["rng/torch"]["global_shape"] == [1, 5056]
    assert sorted(os.listdir(folder)) == ["manifest.json", "rank00000.safetensors"]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("call,match", [
    (lambda d: Checkpointer(d, keep=0), "keep must be an int >= 1"),
    (lambda d: Checkpointer(d).save(-1, model=nn.Linear(1, 1)), "step must be an int >= 0"),
    (lambda d: Checkpointer(d).save(1.5, model=nn.Linear(1, 1)), "step must be an int"),
    (lambda d: Checkpointer(d).save(1, extra=[1]), "extra must be a dict"),
    (lambda d: Checkpointer(d).save(1, extra={"a": np.ones(2)}), "extra/a: cannot checkpoint"),
])
def test_bad_arguments_say_what_to_fix(tmp_path, call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call(tmp_path)
    assert not any(n.startswith("step_") for n in os.listdir(tmp_path)) if tmp_path.exists() else True


@pytest.mark.timeout(20)
def test_load_without_saved_optimizer_says_so(tmp_path):
    model, opt = _fresh()
    Checkpointer(tmp_path).save(1, model=model)
    with pytest.raises(CheckpointMismatchError, match="holds no optimizer state"):
        Checkpointer(tmp_path).load(model=model, optimizer=opt)
