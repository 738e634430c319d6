"""Rank FAIL_RANK (argv[1], default 1) raises after printing; the others wait to be stopped."""

import os
import sys
import time


def check(value):
    raise ValueError(f"boom on rank {os.environ['RANK']} with value {value}")


fail_rank = int(sys.argv[1]) if len(sys.argv) > 1 else 1
print(f"started rank {os.environ['RANK']}", flush=True)
if int(os.environ["RANK"]) == fail_rank:
    check(42)
time.sleep(60)  # the launcher must stop this rank long before
