import pytest
import torch

from disttrain.testing import RankFailedError, spawn
from tests.dist import _spawn_fns as fns


@pytest.mark.timeout(60)
def test_spawn_returns_results_in_rank_order():
    out = spawn(fns.sum_of_ranks, 3, 2.0)
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert all(o["world"] == 3 for o in out)
    for o in out:
        torch.testing.assert_close(o["sum"], torch.tensor([6.0]))


@pytest.mark.timeout(60)
def test_failing_rank_is_named_with_its_traceback():
    with pytest.raises(RankFailedError) as info:
        spawn(fns.rank_one_raises, 2)
    assert info.value.rank == 1
    assert "rank one says no" in str(info.value)
    assert "rank 1 failed" in str(info.value)


@pytest.mark.timeout(60)
def test_timeout_names_the_unfinished_rank():
    # NOTE: on a loaded machine rank 0 may not have started its work within 5 s either;
    # the sleeping rank 1 must be named whatever happens to rank 0. (Suite time: the test
    # waits the whole timeout.)
    with pytest.raises(TimeoutError, match=r"ranks \[(0, )?1\] did not finish within 5s"):
        spawn(fns.rank_one_sleeps, 2, timeout=5)


@pytest.mark.timeout(60)
def test_rank_that_dies_without_a_traceback_is_named_with_its_exit_code():
    with pytest.raises(RankFailedError, match="rank 1 died with exit code 3") as info:
        spawn(fns.rank_one_exits, 2)
    assert info.value.rank == 1


@pytest.mark.timeout(90)
@pytest.mark.parametrize("start_method", [None, "spawn"])
def test_ranks_see_the_callers_environment_at_the_call_and_their_own_seeds(
        monkeypatch, start_method):
    spawn(fns.sum_of_ranks, 1, 1.0, start_method=start_method)  # the fork server is up now
    monkeypatch.setenv("DISTTRAIN_TEST_SET_LATER", "parent")
    monkeypatch.delenv("DISTTRAIN_TEST_GONE", raising=False)
    names = ["DISTTRAIN_TEST_SET_LATER", "DISTTRAIN_TEST_GIVEN", "DISTTRAIN_TEST_GONE"]
    out = spawn(fns.environment_and_seed, 2, names, env={"DISTTRAIN_TEST_GIVEN": "env"},
                start_method=start_method)
    for o in out:
        assert o["env"] == {"DISTTRAIN_TEST_SET_LATER": "parent", "DISTTRAIN_TEST_GIVEN": "env",
                            "DISTTRAIN_TEST_GONE": None}
        assert o["threads"] == 1
    assert out[0]["numpy"] != out[1]["numpy"]


def test_an_unknown_start_method_is_refused_with_the_usable_ones():
    with pytest.raises(ValueError, match=r"start_method must be one of \[.*'spawn'\], got 'fork'"):
        spawn(fns.sum_of_ranks, 1, 1.0, start_method="fork")
