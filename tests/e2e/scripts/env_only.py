"""Print this rank's launcher environment as one JSON line (standard library only)."""

import json
import os

keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_RUN_ID")
print("ENV " + json.dumps({k: os.environ.get(k) for k in keys}), flush=True)
