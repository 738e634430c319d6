"""Server pieces without processes: shard construction, optimizer step, snapshot/restore,
and restart reports that count lost updates only from this job's own side file."""

import os

import pytest
import torch

from disttrain.ps import snapshot as snap
from disttrain.ps.connect import format_stats
from disttrain.ps.placement import plan_keys
from disttrain.ps.policy import Async, KSync
from disttrain.ps.server import Server

SECRET = bytes(32)


def _server(policy, init, opt=lambda p: torch.optim.Adam(p, lr=0.1), secret=SECRET):
    plan = plan_keys([(n, t.numel(), 4) for n, t in init.items()], 1, chunk_bytes=16)
    return Server(0, plan[0], init, policy, opt, [0, 1], secret)


def _close(server):
    server.close()


@pytest.mark.timeout(20)
def test_chunked_shard_steps_like_whole_tensors_and_snapshots(tmp_path):
    torch.manual_seed(0)
    init = {"w": torch.randn(3, 5), "b": torch.randn(5)}
    s = _server(Async(), init)
    assert s.address.startswith("ipc://")  # loopback: a Unix socket in a private folder
    folder = os.path.dirname(s.address.removeprefix("ipc://"))
    assert os.stat(folder).st_mode & 0o077 == 0
    assert s.keys[:2] == ["w#0", "w#1"] and len(s.keys) == 4 + 2  # 15 floats -> 4 chunks
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    ref_opt = torch.optim.Adam(ref.values(), lr=0.1)
    for _ in range(3):
        grads = {k: torch.randn_like(v) for k, v in init.items()}
        for k, p in ref.items():
            p.grad = grads[k]
        ref_opt.step()
        flat = {c.key: grads[c.name].reshape(-1)[c.start:c.stop] for c in s.chunks}
        s._apply([flat], [0])
    for c in s.chunks:
        torch.testing.assert_close(s.params[c.key].detach(),
                                   ref[c.name].detach().reshape(-1)[c.start:c.stop])
    s.policy.version = 3
    path = str(tmp_path / "ps0.safetensors")
    s.snapshot(path)
    fresh = _server(Async(), {k: torch.zeros_like(v) for k, v in init.items()})
    fresh.restore(path)
    assert fresh.policy.version == 3
    for k in s.keys:
        torch.testing.assert_close(fresh.params[k], s.params[k])
        p, q = s.params[k], fresh.params[k]
        torch.testing.assert_close(fresh.optimizer.state[q]["exp_avg"], s.optimizer.state[p]["exp_avg"])
    _close(s)
    _close(fresh)
    assert not os.path.exists(folder)


@pytest.mark.timeout(20)
def test_restore_of_another_model_names_missing_keys(tmp_path):
    s = _server(KSync(2), {"w": torch.ones(2)})
    path = str(tmp_path / "ps0.safetensors")
    s.snapshot(path)
    other = _server(KSync(2), {"v": torch.ones(2)})
    with pytest.raises(ValueError, match="lacks keys"):
        other.restore(path)
    _close(s)
    _close(other)


OTHER_JOB = bytes([7]) * 32


def _job_ran(path, secret=SECRET, snapshot_at=5, reached=7):
    """A job whose server snapshotted `path` at `snapshot_at` and then reached `reached`."""
    s = _server(Async(), {"w": torch.ones(4)}, secret=secret)
    assert s.keep_snapshots(path, every=snapshot_at) is None
    for _ in range(reached):
        s.policy.version += 1
        s._after_update()
    _close(s)


@pytest.mark.timeout(20)
def test_same_job_restart_counts_updates_lost_since_the_snapshot(tmp_path):
    path = str(tmp_path / "ps0.safetensors")
    _job_ran(path)
    s = _server(Async(), {"w": torch.zeros(4)})
    report = s.keep_snapshots(path, every=5)
    assert report == (f"[ps server0] restored version 5 from {path}; 2 updates since that "
                      "snapshot were lost (the server had reached version 7)")
    assert s.stats()["lost_updates"] == 2 and torch.equal(s.params["w"].detach(), torch.ones(4))
    _close(s)


@pytest.mark.timeout(20)
def test_snapshot_and_side_file_of_another_job_are_not_counted_as_lost_updates(tmp_path):
    path = str(tmp_path / "ps0.safetensors")
    _job_ran(path, secret=OTHER_JOB)
    s = _server(Async(), {"w": torch.zeros(4)})
    report = s.keep_snapshots(path, every=5)
    theirs, ours = snap.job_id(OTHER_JOB), snap.job_id(SECRET)
    assert report == (f"[ps server0] restored version 5 from {path}; lost updates not counted, "
                      f"ignoring {path}.version: written by another job (job id {theirs}; this "
                      f"job is {ours}) (the snapshot was saved by another job, job id {theirs}: "
                      "resuming from it; delete it to start afresh)")
    assert s.stats()["lost_updates"] is None
    assert "restored version 5 (lost updates unknown)" in format_stats(s.stats())
    # the side file now belongs to this job, from the restored version on
    assert snap.read_side(path + ".version") == (ours, 5)
    _close(s)
    for f in (path, path + ".version"):  # the job id is a one-way hash, never the secret
        raw = open(f, "rb").read()
        assert SECRET.hex().encode() not in raw and OTHER_JOB.hex().encode() not in raw


@pytest.mark.timeout(20)
def test_a_stale_side_file_alone_is_ignored_and_named(tmp_path):
    path = str(tmp_path / "ps0.safetensors")
    _job_ran(path, secret=OTHER_JOB)
    os.remove(path)
    s = _server(Async(), {"w": torch.zeros(4)})
    report = s.keep_snapshots(path)
    assert report.startswith(f"[ps server0] found no snapshot at {path}; ignoring {path}.version: "
                             f"written by another job (job id {snap.job_id(OTHER_JOB)}")
    assert report.endswith("starting from version 0") and "restored_version" not in s.stats()
    _close(s)
    with open(path + ".version", "w") as f:  # the old format: a bare number
        f.write(f"{13:20d}\n")
    s = _server(Async(), {"w": torch.zeros(4)})
    assert "not in disttrain's side-file format" in s.keep_snapshots(path)
    _close(s)
