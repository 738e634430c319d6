"""A server joins a running job (replicas=1): it takes its share of the keys while workers train.

`disttrain run --workers 2 --servers S` (S = 2 or 3): worker 0 starts the job's script
again with `disttrain ps add-server` (scripts/ps_join.py) right after a push was sent.
The job must end with rc 0, the hand-over named in the output (each old owner's keys and
the routes that serve them), and under Sync the final parameters bitwise equal to a
single-process reference of the same training (what a run without the join ends with);
under Async every push applied exactly once (one-hot gradients count it); the manager's
status after the join lists the joiner as the holder of the moved keys.
"""

import re
from functools import partial
from pathlib import Path

import pytest

from tests.e2e import test_ps_failover as failover
from tests.e2e._ps_membership import (
    assert_bitwise_reference,
    assert_each_push_at_most_once,
    assert_each_push_once,
    assert_example_matches_plain,
    assert_status_chains,
)

SCRIPT = Path(__file__).parent / "scripts" / "ps_join.py"

launch = partial(failover.launch, servers=2, script=SCRIPT)
"""(exit code, output) of a job of this script (2 servers unless told); -1 if it hangs."""


def check_join(code: int, out: str, new: int) -> set[str]:
    """The old owners that handed keys over, each re-routed by both workers."""
    assert code == 0, out
    assert re.search(rf"ring version \d+: server {new} joined at \S+: the keys the placement "
                     rf"on {new + 1} servers gives it move to it \(joining\)", out), out
    handed = set(re.findall(rf"\[ps server(\d)\] handed \d+ keys \([\d.]+ MB with optimizer "
                            rf"state\) to joining server {new} at version \d+", out))
    assert handed, out
    for x in handed:
        assert re.search(rf"\[ps server{new}\] took over \d+ keys \([\d.]+ MB\) of \w+ server "
                         rf"{x} at", out), out
        for w in (0, 1):
            assert re.search(rf"\[ps worker{w}\] server {x} handed \d+ keys to joining server "
                             rf"{new} \(it answered moved at ring version \d+\); its keys are "
                             rf"served by server {x} \(\d+ keys, version \d+\), server {new}",
                             out), out
    assert "worker 0: the added server ended with 0" in out, out
    assert_status_chains(out, new, replicas=1)
    return handed


@pytest.mark.slow  # NOTE: 40 s on the 2-core machine: four Python processes and the joiner's
@pytest.mark.timeout(200)
def test_sync_join_mid_run_ends_bitwise_equal():
    code, out = launch("sync", "3")
    check_join(code, out, new=2)
    assert_bitwise_reference(out)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("servers,step", [(2, 1), (2, 9), (3, 2), (3, 6)])
def test_sync_join_at_any_point_ends_bitwise_equal(servers, step):
    code, out = launch("sync", str(step), servers=servers)
    check_join(code, out, new=servers)
    assert_bitwise_reference(out)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("servers,step", [(2, 4), (3, 7)])
def test_async_join_applies_every_push_exactly_once(servers, step):
    code, out = launch("count", str(step), servers=servers)
    check_join(code, out, new=servers)
    assert_each_push_once(out)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("servers,step", [(2, 3), (3, 6)])
def test_ssp_join_applies_every_push_exactly_once(servers, step):
    """SSP(2): what Async guarantees, with workers held within 2 clocks of each other; the
    routes start fresh policy instances (their clocks start again at the hand-over)."""
    code, out = launch("count-ssp", str(step), servers=servers)
    check_join(code, out, new=servers)
    assert_each_push_once(out)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode,k,servers,step", [("count-ksync", 1, 2, 4), ("count-ksync", 1, 3, 2),
                                                  ("count-kbatch", 2, 2, 4), ("count-kbatch", 2, 3, 6)])
def test_k_modes_join_applies_no_push_twice_nor_half_a_round(mode, k, servers, step):
    """KSync(1): a round applies its first push alone, a later one on a closed round's
    version is dropped. KBatchSync(2): a round averages the first 2 pushes from any
    workers and cancels the rest. Across the hand-over no push is applied twice (a re-sent
    one is on a closed round's version, or the route's clocks hold it) and no round half
    (the owner hands over between rounds). KBatchSync also must not hang: while its keys
    are copied an owner acknowledges a push on receipt, as without a copy (a half-filled
    round waits for a push that a worker blocked on its acknowledgement never sends)."""
    code, out = launch(mode, str(step), servers=servers)
    check_join(code, out, new=servers)
    assert_each_push_at_most_once(out, k=k)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_digits_example_add_server_flag_matches_an_uninterrupted_run():
    assert_example_matches_plain(launch, ["--add-server-at", "10"],
                                 r"\[ps server\d\] handed \d+ keys .* to joining server 2")
