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

import json
import re
from functools import partial

import pytest

from tests.e2e import test_ps_failover as failover
from tests.e2e._ps_membership import EXAMPLE, assert_bitwise_reference, assert_each_push_once
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


def check_status_chains(out: str, new: int, replicas: int = 2) -> None:
    """The manager's status after the join (scripts/ps_join.py prints it): each key listed
    once, with `replicas` copies, under the server heading it; the joiner heads the moved
    keys, the chains those of join_chains.py's `chains_after` (the old owners' kept keys
    as registered)."""
    got = re.search(r"worker 0: status at ring version \d+: status chains (\{.*\}) \((\d+) "
                    r"rows\)", out)
    want = re.search(r"worker 0: chains after (\{.*\})", out)
    assert got and want, out
    listed, after = json.loads(got.group(1)), json.loads(want.group(1))
    assert int(got.group(2)) == len(listed) == len(after), out  # each key once
    assert {k: chain for k, (_, chain) in listed.items()} == after, out
    assert all(len(set(c)) == replicas == len(c) and c[0] == s for s, c in listed.values()), out
    assert any(s == new for s, _ in listed.values()), out
    assert re.search(rf"\[ps manager\] ring version \d+: server {new} heads \d+ keys \([\d.]+ "
                     rf"MB\) of server \d with {replicas} copies each, chains \[{new}, ", out), out


@pytest.mark.slow  # NOTE: about 30 s each on the 2-core machine: four processes and the joiner
@pytest.mark.timeout(900)
@pytest.mark.parametrize("servers,step", [(2, 3), (2, 9), (3, 2), (3, 7)])
def test_sync_join_with_replicas_ends_bitwise_equal(servers, step):
    code, out = launch("sync", str(step), "2", servers=servers)
    check_join_r2(code, out, new=servers)
    check_status_chains(out, new=servers)
    assert_bitwise_reference(out)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("servers,step", [(2, 4), (3, 6)])
def test_async_join_with_replicas_applies_every_push_exactly_once(servers, step):
    code, out = launch("count", str(step), "2", servers=servers)
    check_join_r2(code, out, new=servers)
    check_status_chains(out, new=servers)
    assert_each_push_once(out)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_digits_example_add_server_with_replicas_matches_an_uninterrupted_run():
    args = ["--epochs", "4", "--replicas", "2"]
    code, plain = launch(*args, script=EXAMPLE)
    assert code == 0, plain
    code, out = launch(*args, "--add-server-at", "5", script=EXAMPLE)
    check_join_r2(code, out, new=2)
    digest = re.compile(r"final parameters sha256 (\w+)")
    assert digest.findall(out) == digest.findall(plain) != [], out
