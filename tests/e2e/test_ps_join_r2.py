"""A server joins a running job with replicas=2: it takes its share of the keys while
workers train, and the job keeps 2 copies of every key throughout.

`disttrain run --workers 2 --servers S` (S = 2 or 3) of scripts/ps_join.py with replicas
2: the tail of each moved range copies it to the joiner, each old owner hands it over
between two rounds and heads its kept keys on, the joiner serves the moved keys as a
route of that owner (docs/design/parameter-server.md, "A server joins", "With
`replicas >= 2`"). The job must end with rc 0, each step named in the output, and under
Sync the final parameters bitwise equal to the single-process reference; under Async
every push applied exactly once (one-hot gradients count it); the manager's status after
the join lists each key with 2 copies, the joiner at the head of the moved keys.
"""

import re
from functools import partial

import pytest

from tests.e2e import test_ps_failover as failover
from tests.e2e._ps_membership import (
    assert_bitwise_reference,
    assert_each_push_once,
    assert_example_matches_plain,
    assert_status_chains,
)
from tests.e2e.test_ps_join import SCRIPT

launch = partial(failover.launch, servers=2, script=SCRIPT)
"""(exit code, output) of a job of this script (2 servers unless told); -1 if it hangs."""


def check_join_r2(code: int, out: str, new: int) -> set[str]:
    """The old owners that handed keys over: each range copied by its tail, installed,
    handed over, served by the joiner's route, and both workers re-routed to it."""
    assert code == 0, out
    assert re.search(rf"\[ps server{new}\] joined ring version \d+ \(replicas=2\): takes", out), out
    handed = set(re.findall(r"\[ps server(\d)\] handed \d+ keys \([\d.]+ MB\) over at version "
                            r"\d+ \(ring version \d+\); it keeps \d+", out))
    assert handed, out
    for x in handed:
        assert re.search(rf"\[ps server\d\] copies [^\n]*\d+ keys of server {x}\b[^\n]* to "
                         rf"joining server {new} \(the tail of their chains\)", out), out
        assert re.search(rf"server {new} holds a copy of \d+ keys \([\d.]+ MB\) of server {x}, "
                         r"from server \d at version \d+: a join: handed over next", out), out
        assert re.search(rf"\[ps server{new}\] serves \d+ keys of server {x} at version \d+", out)
        for w in (0, 1):
            assert re.search(rf"\[ps worker{w}\] server {x} handed \d+ keys to joining server "
                             rf"{new} \(it answered moved at ring version \d+\); its keys are "
                             rf"served by server {x} \(\d+ keys, version -?\d+\), server {new}",
                             out), out
    assert "worker 0: the added server ended with 0" in out, out
    return handed


@pytest.mark.slow  # NOTE: about 30 s each on the 2-core machine: four processes and the joiner
@pytest.mark.timeout(900)
@pytest.mark.parametrize("servers,step", [(2, 3), (2, 9), (3, 2), (3, 7)])
def test_sync_join_with_replicas_ends_bitwise_equal(servers, step):
    code, out = launch("sync", str(step), "2", servers=servers)
    check_join_r2(code, out, new=servers)
    assert_status_chains(out, new=servers, replicas=2)
    assert_bitwise_reference(out)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("servers,step", [(2, 4), (3, 6)])
def test_async_join_with_replicas_applies_every_push_exactly_once(servers, step):
    code, out = launch("count", str(step), "2", servers=servers)
    check_join_r2(code, out, new=servers)
    assert_status_chains(out, new=servers, replicas=2)
    assert_each_push_once(out)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_digits_example_add_server_with_replicas_matches_an_uninterrupted_run():
    assert_example_matches_plain(launch, ["--add-server-at", "5"],
                                 args=("--epochs", "4", "--replicas", "2"),
                                 check=lambda code, out: check_join_r2(code, out, new=2))
