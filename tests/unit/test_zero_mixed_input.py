"""ZeRO mixed precision and param groups, without processes: bad input says how to fix
it, the loss scaler's arithmetic, and how parameters are assigned to groups."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import disttrain
from disttrain.parallel.zero.groups import assign_groups


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))


def adamw(ps):
    return torch.optim.AdamW(ps)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kwargs, message", [
    ({"precision": "fp8"}, "precision must be one of ['bf16', 'fp16', 'fp32']"),
    ({"precision": "bf16", "loss_scaler": disttrain.LossScaler()}, "needs no scaling"),
    ({"precision": "fp16", "loss_scaler": 2.0 ** 16}, "must be a disttrain.LossScaler"),
    ({"precision": "bf16", "reduce_dtype": torch.float64}, "reduce_dtype must be None"),
    ({"reduce_dtype": torch.bfloat16}, "or torch.float32 with precision='fp32'"),
])
def test_zero_rejects_bad_precision_arguments_before_communicating(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message.replace("[", r"\[")
                       .replace("]", r"\]")):
        disttrain.Zero(net(), adamw, stage=1, **kwargs)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kwargs, message", [
    ({"init_scale": 0}, "init_scale must be a finite number > 0"),
    ({"init_scale": float("inf")}, "init_scale must be a finite number > 0"),
    ({"backoff_factor": 1.5}, "backoff_factor must be in"),
    ({"growth_factor": 0.5}, "growth_factor must be >= 1"),
    ({"growth_interval": 0}, "growth_interval must be an int >= 1"),
    ({"min_scale": 2.0 ** 20}, "min_scale must be in"),
])
def test_loss_scaler_config_errors_say_what_to_use(kwargs, message):
    with pytest.raises(ValueError, match=message):
        disttrain.LossScaler(**kwargs)


@pytest.mark.timeout(10)
def test_loss_scaler_backs_off_on_overflow_and_grows_after_the_interval():
    s = disttrain.LossScaler(init_scale=8.0, growth_interval=2, min_scale=2.0)
    seen = []
    for overflow in (False, False, True, False, True, True, True, False):
        s.update(overflow)
        seen.append(s.scale)
    assert seen == [8.0, 16.0, 8.0, 8.0, 4.0, 2.0, 2.0, 2.0]
    assert s.skipped == 4 and s.growth_tracker == 1
    t = disttrain.LossScaler()
    t.load_state_dict(s.state_dict())
    assert (t.scale, t.growth_tracker, t.skipped) == (2.0, 1, 4)
    with pytest.raises(ValueError, match="saved with precision='fp16'"):
        t.load_state_dict({})


def _params(m):
    return [p for p in m.parameters() if p.requires_grad]


@pytest.mark.timeout(10)
def test_groups_by_function_and_by_name_list():
    m = net()
    group_of, options = assign_groups(m, _params(m),
                                      lambda n, p: {"weight_decay": 0.0} if p.ndim == 1 else {})
    assert options == [{}, {"weight_decay": 0.0}]
    assert [group_of[id(p)] for p in m.parameters()] == [0, 1, 1, 1, 0, 1]
    group_of, options = assign_groups(m, _params(m), [{"params": ["2.weight"], "lr": 0.1}])
    assert options == [{"lr": 0.1}, {}]  # the unnamed rest: a last group of its own
    assert [group_of[id(p)] for p in m.parameters()] == [1, 1, 1, 1, 0, 1]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("spec, message", [
    ([{"params": ["2.wieght"], "lr": 0.1}], "names '2.wieght', which is not a parameter"),
    ([{"params": ["0.bias"]}, {"params": ["0.bias"]}], "is in param_groups 0 and 1"),
    ([{"params": "0.bias"}], "must be a non-empty list of parameter names"),
    ([{"params": ["frozen"]}], "does not require grad"),
    ({"params": ["0.bias"]}, "param_groups must be a function"),
    (lambda n, p: 0.0, "return a dict of optimizer options"),
    (lambda n, p: {"params": []}, "without 'params'"),
])
def test_bad_groups_say_how_to_fix_them(spec, message):
    m = net()
    m.frozen = nn.Parameter(torch.zeros(2), requires_grad=False)
    with pytest.raises((ValueError, TypeError), match=message):
        assign_groups(m, _params(m), spec)
