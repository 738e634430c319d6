"""JSON skeleton + tensors encoding of state trees, and RNG capture, without pickle."""

import random

import numpy as np
import pytest
import torch

from disttrain.checkpoint import state


@pytest.mark.timeout(10)
def test_optimizer_state_dict_round_trips_exactly():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.8, 0.99))
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    skeleton, tensors = state.encode(sd, "optimizer")
    assert set(tensors) == {f"optimizer/state/{i}/{k}" for i in (0, 1)
                            for k in ("step", "exp_avg", "exp_avg_sq")}
    back = state.decode(skeleton, tensors.__getitem__)
    assert back["param_groups"] == sd["param_groups"]  # int keys, tuples, floats intact
    assert isinstance(back["param_groups"][0]["betas"], tuple)
    assert set(back["state"]) == {0, 1}
    assert list(state.leaves(skeleton)) == list(tensors)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("bad,where", [
    ({"a": np.zeros(2)}, "x/a: cannot checkpoint a ndarray"),
    ({"a": [object()]}, "x/a/0: cannot checkpoint a object"),
    ({1: 2, "b": 3}, "dict keys must be all str or all int"),
    ({"__tensor__": 1}, "reserved"),
])
def test_values_json_cannot_say_are_refused_with_their_path(bad, where):
    with pytest.raises((TypeError, ValueError), match=where):
        state.encode(bad, "x")


@pytest.mark.timeout(10)
def test_rng_states_restore_the_same_draws():
    json_part, tensors = state.capture_rng()
    expected = (torch.rand(3), random.random(), np.random.rand(2))
    torch.manual_seed(123)
    random.seed(4)
    np.random.seed(5)
    state.restore_rng(json_part, tensors)
    got = (torch.rand(3), random.random(), np.random.rand(2))
    assert torch.equal(got[0], expected[0])
    assert got[1] == expected[1]
    assert np.array_equal(got[2], expected[2])
