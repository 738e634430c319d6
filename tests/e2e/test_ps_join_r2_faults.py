"""A server joins with replicas=2 and an old owner X is SIGKILLed after its tail's cut,
before it handed its keys over, through `disttrain run`.

scripts/ps_join_kill_owner.py runs scripts/ps_join.py's job (2 workers, Sync with
momentum, a server added at step 3 of 30, replicas=2); the tail T of X's moved range kills
X right after it cut that range for the joiner Y. X's death is an ordinary takeover by the
first live copy of its chains; T ends its copy to Y; Y drops the copies of X's keys and
says so; an old owner one of whose moved chains held X keeps its keys (Y drops those copies
too), one whose chains did not hands over as usual and Y serves it; the add-server process
ends with 0, the workers re-route X's keys to the takeover, and the final parameters are
bitwise the single-process reference's (docs/design/parameter-server.md, "A server joins",
"With `replicas >= 2`", "Faults").
"""

import re
from functools import partial
from pathlib import Path

import pytest

from tests.e2e import test_ps_failover as failover
from tests.e2e._ps_membership import assert_bitwise_reference, assert_each_push_once

SCRIPT = Path(__file__).parent / "scripts" / "ps_join_kill_owner.py"

launch = partial(failover.launch, script=SCRIPT)
"""(exit code, output) of a job of this script; -1 if it hangs (170 s)."""

GOES_ON = {(2, 0): set(), (2, 1): set(), (3, 0): {2}, (3, 2): {0}}
"""(servers, X) -> the other old owners whose moved chains do not hold X: they hand over.
(The job's pairs, join_tails.tail_pairs: 2 servers (0, 1), (1, 0); 3 servers (0, 1), (2, 1).)"""


@pytest.mark.slow  # NOTE: about 40 s each on the 2-core machine (four processes and the joiner)
@pytest.mark.timeout(400)
@pytest.mark.parametrize("servers,victim", sorted(GOES_ON))
def test_an_old_owner_killed_after_the_tails_cut_is_taken_over_and_the_joiner_drops_its_keys(
        servers, victim):
    code, out = launch("sync", "3", str(victim), servers=servers)
    new, others = servers, {0, 1} if servers == 2 else {0, 2}
    assert code == 0, out
    tail = re.search(rf"server (\d) kills server {victim} after its cut", out)
    assert tail, out
    assert re.search(rf"\[ps server{tail[1]}\] copies [^\n]*keys of server {victim}\b", out), out
    assert f"server rank {2 + victim} killed (SIGKILL); its replicas take over" in out, out
    took = failover.TOOK.findall(out)
    assert took and {d for *_, d, _ in took} == {str(victim)}, out
    assert re.search(rf"\[ps server{tail[1]}\] ends its copy of \d+ keys of server {victim} to "
                     rf"joining server {new}: a server of their chains died", out), out
    assert re.search(rf"\[ps server{new}\] server {victim} died before it handed its keys "
                     r"over: the copies of its \d+ keys here are dropped", out), out
    assert not re.search(rf"\[ps server{victim}\] handed", out), out
    assert not re.search(rf"serves \d+ keys of server {victim}\b", out), out
    for x in others - {victim}:
        if x in GOES_ON[(servers, victim)]:
            assert re.search(rf"\[ps server{x}\] handed \d+ keys", out), out
            assert re.search(rf"\[ps server{new}\] serves \d+ keys of server {x}\b", out), out
        else:
            assert re.search(rf"\[ps server{x}\] keeps its \d+ keys for joining server {new}",
                             out), out
            assert re.search(rf"\[ps server{new}\] server {x} keeps its keys", out), out
    for w in (0, 1):
        assert re.search(rf"\[ps worker{w}\] server {victim} died; its keys are served by "
                         r"server \d", out), out
    assert "worker 0: the added server ended with 0" in out, out
    assert_bitwise_reference(out)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("servers,victim,goes_on", [(2, 0, None), (3, 2, 1)])
def test_async_pushes_are_each_applied_once_across_an_old_owner_killed_after_the_cut(
        servers, victim, goes_on):
    """Async, one-hot pushes (its pairs at 3 servers: (1, 0), (2, 1)): every push counts
    once although X died, the joiner dropped X's copies and server 1 handed its keys over
    to the joiner. At 2 servers, X = 0, worker 1 ends its 30 steps before the kill and
    waits at the barrier with nothing sent: it must re-route idle, or the route counts it
    lost after its grace and ends with worker 0's done, and its final pull met silence."""
    code, out = launch("count", "3", str(victim), servers=servers)
    assert code == 0, out
    assert re.search(rf"server \d kills server {victim} after its cut", out), out
    assert re.search(rf"\[ps server{servers}\] server {victim} died before it handed its keys "
                     r"over: the copies of its \d+ keys here are dropped", out), out
    if goes_on is not None:
        assert re.search(rf"\[ps server{servers}\] serves \d+ keys of server {goes_on}\b", out), out
    for w in (0, 1):
        assert re.search(rf"\[ps worker{w}\] server {victim} died; its keys are served by "
                         r"server \d", out), out
    assert "worker 0: the added server ended with 0" in out, out
    assert_each_push_once(out)
