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


@pytest.mark.timeout(10)
def test_merge_unions_keys_and_refuses_disagreeing_values():
    opt_a = state.encode({"state": {0: {"step": 1.0}}, "param_groups": [{"lr": 0.1}]}, "o")[0]
    opt_b = state.encode({"state": {1: {"step": 1.0}}, "param_groups": [{"lr": 0.1}]}, "o")[0]
    merged = state.merge(opt_a, opt_b, "o")
    assert state.decode(merged, None) == {"state": {0: {"step": 1.0}, 1: {"step": 1.0}},
                                          "param_groups": [{"lr": 0.1}]}
    stage0 = state.encode({"0.weight": torch.zeros(1)}, "model")[0]
    stage1 = state.encode({"2.weight": torch.zeros(1)}, "model")[0]
    assert list(state.leaves(state.merge(stage0, stage1, "model"))) == [
        "model/0.weight", "model/2.weight"]
    other_lr = state.encode({"param_groups": [{"lr": 0.2}]}, "o")[0]
    with pytest.raises(ValueError, match="o/param_groups/0/lr: 0.1 on one rank, 0.2 on another"):
        state.merge(opt_a, other_lr, "o")


@pytest.mark.timeout(10)
def test_prune_keeps_this_ranks_tensors_and_every_value():
    skeleton, _ = state.encode({"state": {0: {"m": torch.ones(1), "step": 3}, 1: {"m": torch.ones(1)}},
                                "w": [torch.ones(1), 5]}, "o")
    pruned = state.prune(skeleton, {"o/state/0/m"})
    assert list(state.leaves(pruned)) == ["o/state/0/m"]
    assert state.decode(pruned, lambda p: p) == {"state": {0: {"m": "o/state/0/m", "step": 3}, 1: {}},
                                                 "w": [None, 5]}
