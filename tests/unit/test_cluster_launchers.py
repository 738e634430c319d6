"""Slurm and MPI environments -> the torchrun environment (pure; a real mpiexec in e2e)."""

import pytest

from disttrain.cluster.launchers import env_from_launcher, first_host

SRUN = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
        "SLURM_JOB_ID": "123456", "SLURM_NTASKS_PER_NODE": "4",
        "SLURM_JOB_NODELIST": "gpu[07-08],cpu1"}


def test_srun_gives_rank_world_local_and_the_first_node_as_master():
    assert env_from_launcher(SRUN) == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu07", "MASTER_PORT": str(15000 + 123456 % 20000)}


def test_torchrun_inside_an_allocation_wins_and_a_batch_script_without_srun_is_not_a_launch():
    assert env_from_launcher({**SRUN, "RANK": "0", "WORLD_SIZE": "2"}) == {}
    assert env_from_launcher({k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}) == {}


@pytest.mark.parametrize("nodelist, host", [("n1", "n1"), ("a[3-5]", "a3"), ("x[10,2]", "x10"),
                                            ("h-1,h-2", "h-1")])
def test_first_host_of_a_node_list(nodelist, host):
    assert first_host(nodelist) == host


def test_open_mpi_on_one_host_meets_on_loopback():
    env = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    assert env_from_launcher(env) == {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2",
                                      "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
                                      "MASTER_PORT": "29500"}


def test_mpi_across_hosts_without_master_addr_says_what_to_export():
    env = {"PMI_RANK": "0", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    with pytest.raises(ValueError, match="export MASTER_ADDR"):
        env_from_launcher(env)
    assert env_from_launcher({**env, "MASTER_ADDR": "h0"})["MASTER_ADDR"] == "h0"


def test_no_launcher_is_an_empty_dict():
    assert env_from_launcher({"HOME": "/root"}) == {}
