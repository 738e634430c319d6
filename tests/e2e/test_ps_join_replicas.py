"""A server added to a job with replicas >= 2: refused (designed, not built: docs/design/
parameter-server.md, "A server joins"), and the job says so at once instead of waiting.

`examples/digits_ps.py --replicas 2 --add-server-at STEP` under `disttrain run`: the
manager refuses the join naming the design and the fix, the joining process exits, and
worker 0 (waiting in `ps.joined(process=...)`) stops the job with that exit, well before
`ps.joined`'s 120 s timeout.
"""

import time
from functools import partial
from pathlib import Path

import pytest

from tests.e2e import test_ps_failover as failover

EXAMPLE = Path(__file__).parents[2] / "examples" / "digits_ps.py"

launch = partial(failover.launch, servers=2, script=EXAMPLE)


@pytest.mark.slow  # NOTE: about 40 s on the loaded 2-core machine (four Python processes, the joiner)
@pytest.mark.timeout(200)
def test_digits_example_add_server_with_replicas_stops_at_once_with_the_reason():
    t0 = time.monotonic()
    code, out = launch("--epochs", "4", "--replicas", "2", "--add-server-at", "5")
    took = time.monotonic() - t0
    assert code not in (0, -1), out
    assert ("server 2 cannot join: with replicas >= 2 a join moves no keys yet (designed, "
            "not built: docs/design/parameter-server.md, \"A server joins\"), with replicas=1 "
            "a server joins live") in out, out
    assert "the joining server's process exited with 1 before it joined" in out, out
    assert took < 90, f"{took:.0f} s:\n{out}"  # ps.joined alone would wait 120 s
