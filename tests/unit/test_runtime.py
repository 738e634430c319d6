"""The runtime as a plain `python script.py` sees it: a world of one."""

import datetime

import pytest
import torch
import torch.distributed as dist

import disttrain
from disttrain import runtime, settings


@pytest.fixture
def plain_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "DISTTRAIN_SERVERS", "DISTTRAIN_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    yield
    disttrain.shutdown()


@pytest.mark.timeout(30)
def test_world_of_one_without_launcher(plain_env, capsys):
    disttrain.init()
    assert disttrain.is_initialized()
    assert (disttrain.rank(), disttrain.world_size(), disttrain.local_rank()) == (0, 1, 0)
    assert disttrain.backend() == "gloo"
    assert disttrain.device() == torch.device("cpu")
    t = torch.ones(3)
    dist.all_reduce(t)  # collectives still work in a world of one
    assert t.tolist() == [1.0, 1.0, 1.0]
    disttrain.init()  # idempotent
    disttrain.print0("hello")
    assert capsys.readouterr().out == "hello\n"
    disttrain.shutdown()
    assert not disttrain.is_initialized()


@pytest.mark.timeout(30)
def test_partial_launcher_env_is_a_clear_error(plain_env, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set"):
        disttrain.init()


def test_nccl_without_gpu_is_refused(plain_env):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ValueError, match="needs CUDA"):
        disttrain.init(backend="nccl")


def test_timeout_from_env(plain_env, monkeypatch):
    assert runtime.default_timeout() == datetime.timedelta(seconds=60)
    monkeypatch.setenv("DISTTRAIN_TIMEOUT", "7.5")
    settings.refresh()
    assert runtime.default_timeout() == datetime.timedelta(seconds=7.5)
    monkeypatch.setenv("DISTTRAIN_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="expected a number of seconds > 0"):
        settings.refresh()


def test_roles_from_server_count(plain_env, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "5")
    monkeypatch.setenv("DISTTRAIN_SERVERS", "2")
    settings.refresh()
    roles = []
    for r in range(5):
        monkeypatch.setenv("RANK", str(r))
        roles.append(disttrain.role())
    assert roles == ["worker", "worker", "worker", "server", "server"]


def test_a_local_rank_without_a_gpu_of_its_own_is_refused_naming_the_fix():
    # NOTE: seen on a one-GPU machine: `disttrain run --nproc 2` failed in rank 1 with
    # CUDA's "invalid device ordinal" from torch.cuda.set_device(1).
    assert runtime.gpu_of(0, 1) == 0 and runtime.gpu_of(3, 4) == 3
    with pytest.raises(RuntimeError, match=r"local rank 1 has no GPU.*sees 1 GPU.*--nproc 1.*CUDA_VISIBLE_DEVICES"):
        runtime.gpu_of(1, 1)
