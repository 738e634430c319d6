"""`disttrain.init()` under other launchers, without torchrun: a real `mpiexec -n 2` (MPICH's,
from the `mpich` wheel in the dev extra) and the environment `srun` gives its tasks."""

import os
import re
import shutil
import socket
import subprocess
import sys

import pytest

MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
SCRIPT = """
import os, torch, disttrain
disttrain.init()                       # reads PMI_* / OMPI_* / SLURM_*: no torchrun here
t = torch.tensor([float(disttrain.rank() + 1)])
disttrain.comm.all_reduce(t)
print(f"rank {disttrain.rank()} of {disttrain.world_size()} local {disttrain.local_rank()} "
      f"sum {t.item():g}", flush=True)
disttrain.shutdown()
"""
EXPECTED = ["rank 0 of 2 local 0 sum 3", "rank 1 of 2 local 1 sum 3"]
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def clean_env():
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS and not k.startswith("SLURM_")}
    with socket.socket() as s:  # a free port: never a busy fixed one
        s.bind(("127.0.0.1", 0))
        env["MASTER_PORT"] = str(s.getsockname()[1])
    return env


def rank_lines(text):
    # NOTE: mpiexec forwards the ranks' stdout unsynchronised, so two ranks' lines can
    # arrive joined ("...sum 3rank 1 of 2..."): find the records, not the lines.
    return sorted(re.findall(r"rank \d+ of \d+ local \d+ sum \d+", text))


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec: `pip install mpich` (in the dev extra)")
def test_mpiexec_ranks_form_one_gloo_world(tmp_path):
    script = tmp_path / "mpi.py"
    script.write_text(SCRIPT)
    out = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(script)], capture_output=True,
                         text=True, timeout=60, env=clean_env())
    assert out.returncode == 0, out.stdout + out.stderr
    assert rank_lines(out.stdout) == EXPECTED


def test_tasks_with_srun_environment_form_one_gloo_world(tmp_path):
    """What `srun -N1 -n2 python train.py` sets in each task (no Slurm on this machine)."""
    script = tmp_path / "slurm.py"
    script.write_text(SCRIPT)
    base = {**clean_env(), "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "77",
            "SLURM_JOB_NODELIST": "localhost", "SLURM_NTASKS_PER_NODE": "2"}
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env={**base, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)})
             for r in (0, 1)]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert rank_lines("".join(outs)) == EXPECTED
