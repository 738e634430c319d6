"""JSON skeleton + tensors encoding of state trees, and RNG capture, without pickle."""

import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disttrain.checkpoint import Checkpointer, state


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


def _trees():
    scalars = st.none() | st.booleans() | st.integers(-2**62, 2**62) | st.text(max_size=5) \
        | st.floats(allow_nan=False, width=64)
    tensors = st.builds(lambda n, seed: torch.randn(n, generator=torch.Generator().manual_seed(seed)),
                        st.integers(0, 4), st.integers(0, 100))
    return st.recursive(
        scalars | tensors,
        lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner)
        | st.dictionaries(st.text(min_size=1, max_size=4).filter(lambda k: not k.startswith("__")),
                          inner, max_size=3)
        | st.dictionaries(st.integers(0, 9), inner, max_size=3),
        max_leaves=8)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@pytest.mark.timeout(60)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=_trees())
def test_any_extra_tree_round_trips_through_a_checkpoint(tree, tmp_path):
    folder = tmp_path / str(abs(hash(repr(tree))))
    Checkpointer(folder).save(1, extra={"x": tree})
    extra = {}
    assert Checkpointer(folder).load(extra=extra, rng=False) == 1
    assert _same(extra["x"], tree)
