"""Hybrid parallel (GPT-3's PP x DP x TP) against the single-process GPT.

parallelize() applies TP, then PP, then DP; each mesh trains the same tiny GPT on the
same global batch (split over dp replicas) and must match the unsharded reference in
losses, first-step gradients and parameters after the steps.
"""

import pytest
import torch
import torch.distributed as dist

import disttrain
from disttrain.mesh import Mesh
from disttrain.testing import spawn
from tests.dist import _gpt_ref as ref


def pp_tp_then_dp_tp():
    expected = ref.reference() if disttrain.rank() == 0 else None
    for shape, kw in (
        (dict(pp=2, tp=2), dict(schedule="1f1b", microbatches=4)),
        (dict(dp=2, tp=2), dict(schedule="1f1b", microbatches=2)),
    ):
        mesh = Mesh(**shape)
        out = ref.run_parallel(mesh, **kw)
        if disttrain.rank() == 0:
            ref.assert_matches_reference(out, expected)
    return True


def pp_dp_tp():
    mesh = Mesh(pp=2, dp=2, tp=2)
    for axis in ("pp", "dp", "tp"):  # each axis group holds exactly the predicted peers
        t = torch.tensor([float(mesh.rank)])
        dist.all_reduce(t, group=mesh.group(axis))
        assert t.item() == sum(mesh.peers(axis)), (axis, mesh.peers(axis))
    expected = ref.reference() if disttrain.rank() == 0 else None
    out = ref.run_parallel(mesh, schedule="interleaved", microbatches=2, num_virtual=2)
    if disttrain.rank() == 0:
        ref.assert_matches_reference(out, expected)
    return mesh.coords


# NOTE: slow-marked for suite time: pp2 x tp2 and dp2 x tp2 are checked against a reference
# in tests/dist/test_tied_pipeline.py and test_sequence_parallel.py, all three axes below.
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_pp_x_tp_and_dp_x_tp_match_single_process():
    assert spawn(pp_tp_then_dp_tp, 4, timeout=110) == [True] * 4


@pytest.mark.timeout(150)
def test_pp_x_dp_x_tp_on_8_processes_matches_single_process():
    coords = spawn(pp_dp_tp, 8, timeout=140)
    assert coords[5] == {"pp": 1, "dp": 0, "tp": 1}
