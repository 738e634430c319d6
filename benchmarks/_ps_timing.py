"""The timed loop the parameter-server benchmarks share (ps_transport.py, ps_replication.py).

One measurement is `WARMUP` untimed iterations, then `iters(nbytes)` timed ones; the result
is the mean seconds per timed iteration. `push_pull` is the parameter server's iteration:
`push()` and `pull()` queued at once (ps-lite style), then `wait()` on both.
"""

from __future__ import annotations

import time
from collections.abc import Callable

WARMUP = 2


def iters(nbytes: int) -> int:
    """Timed iterations for `nbytes` each way: about 64 MB in all, at least 5, at most 200."""
    return max(5, min(200, (256 << 20) // max(nbytes, 1) // 4))


def seconds_per_iter(step: Callable[[], object], nbytes: int) -> float:
    """Mean seconds of `step()` over `iters(nbytes)` calls after `WARMUP` untimed ones; blocks
    as long as `step` does."""
    n = iters(nbytes)
    for i in range(n + WARMUP):
        if i == WARMUP:
            t0 = time.perf_counter()
        step()
    return (time.perf_counter() - t0) / n


def push_pull(conn) -> None:
    """One push+pull on a worker's connection; blocks until both are answered.

    NOTE: the pull queues behind the push on the same socket, so it answers with the
    version that includes this gradient.
    """
    pushed = conn.push()
    conn.pull().wait()
    pushed.wait()


def time_push_pull(conn, nbytes: int) -> float:
    """Seconds per push+pull of an `nbytes` parameter on `conn` (its gradient already set);
    blocks for the whole measurement, then closes `conn`."""
    dt = seconds_per_iter(lambda: push_pull(conn), nbytes)
    conn.close()
    return dt
