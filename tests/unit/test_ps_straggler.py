"""Straggler delay models: parsing, errors, reproducibility."""

import statistics

import pytest

from disttrain.ps.straggler import Straggler, parse_straggler


@pytest.mark.timeout(10)
def test_exp_is_seeded_reproducible_and_has_its_mean():
    s = parse_straggler("exp:mean=0.05", seed=3)
    draws = [s.delay(r, t) for r in range(4) for t in range(500)]
    assert draws == [parse_straggler("exp:mean=0.05", seed=3).delay(r, t)
                     for r in range(4) for t in range(500)]
    assert draws != [parse_straggler("exp:mean=0.05", seed=4).delay(r, t)
                     for r in range(4) for t in range(500)]
    assert abs(statistics.mean(draws) - 0.05) < 0.006
    assert min(draws) >= 0


@pytest.mark.timeout(10)
def test_shifted_exp_and_fixed_and_none():
    s = parse_straggler("shifted-exp:shift=0.02,mean=0.05")
    assert min(s.delay(0, t) for t in range(300)) >= 0.02
    f = parse_straggler("fixed:rank=2,delay=0.2")
    assert f.delay(2, 7) == 0.2 and f.delay(1, 7) == 0.0
    assert parse_straggler(None).delay(0, 0) == 0.0
    assert parse_straggler("none") == Straggler()


@pytest.mark.timeout(10)
@pytest.mark.parametrize("spec, match", [
    ("gauss:mean=1", "unknown model"),
    ("exp", "missing"),
    ("exp:mean=abc", "not a number"),
    ("exp:sigma=1", "is not one of"),
    ("exp:mean=-1", ">= 0"),
    ("fixed:rank=1.5,delay=0.1", "integer"),
])
def test_bad_specs_say_how_to_fix(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_straggler(spec)
