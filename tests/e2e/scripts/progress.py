"""Rank 0 draws a tqdm bar to stderr; every rank prints a line."""

import os
import sys

from tqdm import tqdm

rank = int(os.environ.get("RANK", 0))
for _ in tqdm(range(3), disable=rank != 0, file=sys.stderr, ascii=True, desc="steps"):
    pass
print(f"done rank {rank}", flush=True)
