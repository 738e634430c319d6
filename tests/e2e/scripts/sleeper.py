"""Write this rank's pid to <folder>/<rank>.pid, then sleep until stopped."""

import os
import sys
import time

folder = sys.argv[1]
path = os.path.join(folder, f"{os.environ['RANK']}.pid")
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(path + ".tmp", path)  # NOTE: atomic, so a reader never sees a half-written pid
print(f"rank {os.environ['RANK']} sleeping", flush=True)
time.sleep(120)
