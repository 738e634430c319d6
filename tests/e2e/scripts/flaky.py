"""Rank 1 fails on the first attempt only; with --max-restarts 1 the job then succeeds."""

import os

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"attempt {attempt} rank {os.environ['RANK']}", flush=True)
if attempt == 0 and os.environ["RANK"] == "1":
    raise RuntimeError("first attempt fails")
