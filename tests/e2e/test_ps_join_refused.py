"""A server added to a job that cannot take one: refused, and the job says so at once
instead of waiting.

`examples/digits_ps.py --add-server-at STEP` under `disttrain run --servers 1`: the
manager refuses the join naming the reason and the fix (one server's keys are whole
tensors), the joining process exits, and worker 0 (waiting in `ps.joined(process=...)`)
stops the job with that exit, well before `ps.joined`'s 120 s timeout.
"""

import time
from functools import partial
from pathlib import Path

import pytest

from tests.e2e import test_ps_failover as failover

EXAMPLE = Path(__file__).parents[2] / "examples" / "digits_ps.py"

launch = partial(failover.launch, servers=1, script=EXAMPLE)


@pytest.mark.slow  # NOTE: about 40 s on the loaded 2-core machine (three Python processes, the joiner)
@pytest.mark.timeout(200)
def test_digits_example_add_server_refused_stops_at_once_with_the_reason():
    t0 = time.monotonic()
    code, out = launch("--epochs", "4", "--add-server-at", "5")
    took = time.monotonic() - t0
    assert code not in (0, -1), out
    assert ("server 1 cannot join: this job has one server, whose keys are whole tensors (two "
            "cut them otherwise): start it with --servers 2 or more") in out, out
    assert "the joining server's process exited with 1 before it joined" in out, out
    assert took < 90, f"{took:.0f} s:\n{out}"  # ps.joined alone would wait 120 s
