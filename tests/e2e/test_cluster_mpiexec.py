"""A real `mpiexec -n 2` (MPICH's, from the `mpich` wheel in the dev extra) gives a working world."""

import os
import shutil
import socket
import subprocess
import sys

import pytest

MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
SCRIPT = """
import os, torch, torch.distributed as dist
from disttrain.cluster.launchers import env_from_launcher
os.environ.update(env_from_launcher(os.environ))   # what runtime.init will do
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} local {os.environ['LOCAL_RANK']} sum {t.item():g}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec: `pip install mpich` (in the dev extra)")
def test_mpiexec_ranks_form_one_gloo_world(tmp_path):
    script = tmp_path / "mpi.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    with socket.socket() as s:  # a free port: never a busy fixed one
        s.bind(("127.0.0.1", 0))
        env["MASTER_PORT"] = str(s.getsockname()[1])
    out = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(script)], capture_output=True,
                         text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = sorted(line for line in out.stdout.splitlines() if line.startswith("rank"))
    assert lines == ["rank 0 of 2 local 0 sum 3", "rank 1 of 2 local 1 sum 3"]
