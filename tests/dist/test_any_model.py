"""Models nobody here wrote, unmodified: Hugging Face GPT-2 (it computes its own loss from
`labels=`) under DataParallel and ZeRO 1-3 on 2 processes, each equal to one process."""

import pytest

import disttrain
from disttrain.mesh import Mesh
from disttrain.testing import spawn
from tests.dist import _hf_ref as ref

LR = ref.LR


def _sgd(params):
    import torch

    return torch.optim.SGD(params, lr=LR)


def data_parallel_and_zero():
    mesh = Mesh(dp=2)
    expected = ref.reference() if disttrain.rank() == 0 else None
    for zero in (0, 1, 2, 3):
        kw = dict(zero=zero, optimizer_factory=_sgd) if zero else {}
        out = ref.run_parallel(mesh, **kw)
        if disttrain.rank() == 0:
            ref.assert_matches(out, expected)
    return True


@pytest.mark.timeout(150)
def test_hf_gpt2_data_parallel_and_zero_match_one_process():
    assert spawn(data_parallel_and_zero, 2, timeout=140) == [True, True]
