import pytest

from ddtrain.errors import DDTrainError
from ddtrain.dist.env import detect_env, first_slurm_host


def test_plain_process_is_a_world_of_one():
    env = detect_env({})
    assert (env.launcher, env.rank, env.world_size) == ("none", 0, 1)


def test_torchrun_environment():
    env = detect_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                      "MASTER_ADDR": "node7", "MASTER_PORT": "1234"})
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("torchrun", 3, 8, 1, 4)
    assert (env.master_addr, env.master_port) == ("node7", 1234)


def test_slurm_environment_takes_the_first_host_as_master():
    env = detect_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                      "SLURM_JOB_NODELIST": "gpu[03-05,9]", "SLURM_TASKS_PER_NODE": "4(x2)"})
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("slurm", 5, 8, 1, 4)
    assert env.master_addr == "gpu03"
    assert detect_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "MASTER_ADDR": "head",
                       "SLURM_JOB_NODELIST": "a1,b2"}).master_addr == "head"


@pytest.mark.parametrize("nodelist,first", [("node1", "node1"), ("cn[001-004]", "cn001"),
                                            ("a[7,9],b1", "a7"), ("x-1,y", "x-1")])
def test_slurm_host_lists(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_open_mpi_and_mpich_environments():
    ompi = detect_env({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
                       "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"})
    assert (ompi.launcher, ompi.rank, ompi.world_size, ompi.local_rank, ompi.master_addr) == \
        ("openmpi", 2, 4, 2, "127.0.0.1")
    mpich = detect_env({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"})
    assert (mpich.launcher, mpich.rank, mpich.world_size, mpich.local_rank) == ("mpich", 1, 2, 1)


def test_multi_host_mpi_without_master_is_refused():
    with pytest.raises(DDTrainError, match="MASTER_ADDR"):
        detect_env({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"})


def test_bad_numbers_are_named():
    with pytest.raises(DDTrainError, match="WORLD_SIZE"):
        detect_env({"RANK": "0", "WORLD_SIZE": "two"})
