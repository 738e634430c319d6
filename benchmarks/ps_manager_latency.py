"""The parameter-server manager's costs: fork to first answer, a lookup's and a status's
round trip (a server of 200 keys registered), on loopback ipc://. Prints medians;
asserts nothing.

    python benchmarks/ps_manager_latency.py
"""

import os
import statistics
import tempfile
import time

from disttrain.ps import manager
from disttrain.ps.manager_link import SERVER_PARTY, ManagerLink

KEY = os.urandom(32)


def timed(call, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        call()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    folder = tempfile.mkdtemp()
    runs = []
    starts = timed(lambda: runs.append(manager.start(
        os.path.join(folder, f"m{len(runs)}.json"), secret=KEY)), 5)
    for run in runs[:-1]:
        run.stop()
    run = runs[-1]
    server = ManagerLink(run.address, SERVER_PARTY, secret=KEY)
    server.request("register", server=0, address="ipc://x", fingerprint="f", expected=1,
                   attempt=0, shard=[{"key": f"k{i}", "bytes": 4096, "chain": [0]}
                                     for i in range(200)])
    worker = ManagerLink(run.address, 0, secret=KEY)
    lookups = timed(lambda: worker.request("lookup"), 300)
    status = timed(lambda: worker.request("status"), 50)
    run.stop()
    print(f"start (fork to first answer): median {statistics.median(starts) * 1e3:.1f} ms of 5 "
          f"(min {min(starts) * 1e3:.1f}, max {max(starts) * 1e3:.1f})")
    print(f"lookup round trip: median {statistics.median(lookups) * 1e6:.0f} us of 300; "
          f"status with 200 keys: median {statistics.median(status) * 1e6:.0f} us of 50")


if __name__ == "__main__":
    main()
