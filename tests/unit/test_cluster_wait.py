"""run_in_cluster's watcher over the nodes' agents (real processes, no namespaces needed)."""

import io
import subprocess
import threading
import time

from disttrain.launch.cluster_run import _wait


def test_a_later_node_failing_while_node_0_runs_stops_the_job():
    # NOTE: it once polled only up to the first running node, so node 1's failure went
    # unseen while node 0 waited for it (a parameter-server job sat in rendezvous)
    procs = [subprocess.Popen(["sleep", "60"], start_new_session=True),
             subprocess.Popen(["sh", "-c", "exit 3"], start_new_session=True)]
    t0 = time.monotonic()
    try:
        assert _wait(procs, 0.5, io.StringIO(), threading.Lock()) == (1, 3)
    finally:
        procs[0].kill()
    assert time.monotonic() - t0 < 30  # SIGTERM after the grace, not sleep's 60 s
    assert procs[0].wait(5) == -15
