"""`disttrain checkpoint inspect|convert` run as a user runs them, on real checkpoints."""

import re
import subprocess
import sys

import pytest
import safetensors.torch
import torch
from torch import nn

from disttrain.checkpoint import Checkpointer, cli


def _cli(*args: str) -> subprocess.CompletedProcess:
    """`disttrain checkpoint ARGS` as a user types it (a process of its own)."""
    return subprocess.run([sys.executable, "-m", "disttrain", "checkpoint", *args],
                          capture_output=True, text=True, timeout=60)


def _cli_here(capsys, *args: str) -> subprocess.CompletedProcess:
    """The same command in this process (saves a torch import per call)."""
    code = cli.main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(10, model=model, optimizer=opt, extra={"lr": 0.1})
    ckpt.save(20, model=model, optimizer=opt, extra={"lr": 0.1})
    return tmp_path / "ckpt", model


@pytest.mark.timeout(60)
def test_inspect_lists_files_tensors_and_checksums(saved, capsys):
    folder, _ = saved
    out = _cli("inspect", str(folder))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "step_00000020  <- latest" in text and "step_00000010" in text
    assert "step 20, saved by 1 rank(s)" in text
    assert "rank00000.safetensors" in text and "ok" in text
    assert "model/0.weight" in text and "[6, 4]" in text and "float32" in text
    assert "2 param group(s)" not in text and "1 param group(s)" in text
    assert "checksums: all ok" in text

    data = folder / "step_00000020" / "rank00000.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0xFF
    data.write_bytes(bytes(raw))
    out = _cli_here(capsys, "inspect", str(folder / "step_00000020"))
    assert out.returncode == 1
    assert "DAMAGED" in out.stdout and "SHA-256" in out.stdout


@pytest.mark.timeout(60)
def test_convert_to_one_file_and_to_plain_weights(saved, tmp_path, capsys):
    folder, model = saved
    out = _cli_here(capsys, "convert", str(folder), "--to", str(tmp_path / "one"))
    assert out.returncode == 0, out.stderr
    fresh = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    assert Checkpointer(tmp_path / "one").load(model=fresh) == 20
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))

    out = _cli_here(capsys, "convert", str(folder), "--to", str(tmp_path / "three"),
                    "--pieces", "3", "--dim", "1")
    assert out.returncode == 0, out.stderr
    text = _cli_here(capsys, "inspect", str(tmp_path / "three")).stdout
    assert re.search(r"model/0.weight +float32 +\[6, 4\] +3 pieces along dim 1\n", text)
    assert re.search(r"model/0.bias +float32 +\[6\] +whole\n", text)
    assert "checksums: all ok" in text
    fresh = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    assert Checkpointer(tmp_path / "three").load(model=fresh) == 20
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))

    out = _cli_here(capsys, "convert", str(folder), "--to", str(tmp_path / "w.safetensors"))
    assert out.returncode == 0, out.stderr
    weights = safetensors.torch.load_file(str(tmp_path / "w.safetensors"))
    assert weights.keys() == model.state_dict().keys()


@pytest.mark.timeout(60)
def test_missing_folder_is_one_clear_line(tmp_path, capsys):
    out = _cli_here(capsys, "inspect", str(tmp_path / "nothing"))
    assert out.returncode == 1
    assert "holds no checkpoint" in out.stderr and "Traceback" not in out.stderr
