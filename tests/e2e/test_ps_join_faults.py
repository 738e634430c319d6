"""A joining server SIGKILLed mid-move (replicas=1), through `disttrain run`.

scripts/ps_join_fault.py runs scripts/ps_join.py's job (2 workers, Sync, a server added
at step 3 of 30); the joining server SIGKILLs itself at a chosen moment (it is not one
of the launcher's ranks: worker 0 started it with `disttrain ps add-server`, and the
manager marks it dead once its heartbeats stop). Before an old owner handed its keys
over, the owner keeps them and the job ends as if nothing joined (Sync: bitwise the
single-process reference); after, the keys it took are lost with it and the job stops
with a message naming it, within a bounded time (never a hang).
"""

import re
from functools import partial
from pathlib import Path

import pytest

from tests.e2e import test_ps_failover as failover
from tests.e2e._ps_membership import assert_bitwise_reference

SCRIPT = Path(__file__).parent / "scripts" / "ps_join_fault.py"

launch = partial(failover.launch, script=SCRIPT)
"""(exit code, output) of a job of this script; -1 if it hangs (170 s)."""


@pytest.mark.slow  # NOTE: 40 to 60 s each on the 2-core machine (the joiner's heartbeats time out)
@pytest.mark.timeout(400)
@pytest.mark.parametrize("servers", [2, 3])
def test_a_joiner_killed_while_keys_are_copied_to_it_leaves_them_with_their_owners(servers):
    code, out = launch("sync", "3", "die-copy", servers=servers)
    assert code == 0, out
    assert "joining server dies on a transfer frame" in out, out
    assert re.search(rf"server {servers} at \S+ missed its heartbeats .*: marked dead", out), out
    kept = re.findall(rf"\[ps server(\d)\] joining server {servers} died before it took the "
                      r"keys: they stay here", out)
    assert kept, out
    assert not re.search(r"handed \d+ keys .* to joining server", out), out
    # the joiner's process was killed: `ps add-server` names it and exits 128+9
    assert re.search(r"worker 0: the added server ended with 137\n", out), out
    assert f"server {servers} (the joining server's process" in out, out
    assert "was killed by SIGKILL: exit 137" in out, out
    assert_bitwise_reference(out)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("fault", ["die-handed", "die-serving"])
def test_a_joiner_killed_after_the_hand_over_stops_the_job_naming_it(fault):
    """die-handed: an old owner handed its keys over, the joiner dies before serving them;
    die-serving: the workers re-routed and pushed to the joiner's routes."""
    code, out = launch("sync", "3", fault, servers=2)
    assert code not in (0, -1), out
    assert re.search(r"\[ps server\d\] handed \d+ keys .* to joining server 2", out), out
    assert re.search(r"server \d handed keys to joining server 2, which died \(the manager's "
                     r"ring version \d+ marks it dead.*\): with replicas=1 they are lost", out), out
    assert "digest" not in out, out
