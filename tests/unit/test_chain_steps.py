"""The chain's steps without processes: what each refuses, the deprecated `dp_options`
alias, and the split backward asking a module (not its type) whether it may run."""

import warnings

import pytest
import torch
from torch import nn

import disttrain
from disttrain.parallel import apply_recompute, apply_tp
from disttrain.parallel.pipeline import Pipeline, make_schedule


def test_dp_options_still_works_and_warns_with_the_new_spelling():
    with pytest.warns(DeprecationWarning, match=r"dp_options.*deprecated.*precision=\.\.\."):
        cfg = disttrain.Parallelism.from_options(
            {"zero": 1, "optimizer_factory": torch.optim.SGD, "dp_options": {"precision": "bf16"}})
    assert cfg.precision == "bf16" and cfg.zero == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert disttrain.Parallelism.from_options({"microbatches": 2}).microbatches == 2


def test_data_parallel_keywords_follow_the_zero_stage():
    assert "zero" not in disttrain.Parallelism(bucket_mb=5).data_parallel_keywords()
    kw = disttrain.Parallelism(zero=2, optimizer_factory=torch.optim.SGD).data_parallel_keywords()
    assert kw["zero"] == 2 and kw["optimizer_factory"] is torch.optim.SGD and "precision" in kw


def test_apply_tp_without_a_plan_says_which_to_pass():
    with pytest.raises(ValueError, match="needs a plan.*plan='auto'"):
        apply_tp(nn.Linear(2, 2), None, None)


def test_apply_recompute_takes_globs_and_true():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert apply_recompute(model, ["*"]) is model
    assert all(type(m).__name__ == "Recompute" for m in model)
    with pytest.raises(TypeError, match="recompute_layers"):
        apply_recompute(nn.Sequential(nn.Linear(2, 2)), True)


class _Refuses(nn.Linear):
    split_backward_refusal = "no split backward over this module: use schedule='1f1b'"


class _WholeW(nn.Linear):
    whole_weight_backward = True


def test_split_backward_asks_the_module_not_its_type():
    zb = make_schedule("zb-h1", 1, 2)[0]
    with pytest.raises(ValueError, match="no split backward over this module"):
        Pipeline([nn.Sequential(_Refuses(2, 2))], zb, 0, 1, 2, lambda o, y: o.sum())
    assert Pipeline([_WholeW(2, 2)], zb, 0, 1, 2, lambda o, y: o.sum())._one_run == [True]
    assert Pipeline([nn.Linear(2, 2)], zb, 0, 1, 2, lambda o, y: o.sum())._one_run == [False]
