import pytest

from ddtrain.errors import DDTrainError
from ddtrain.distributed.env import (DEFAULT_PORT, LaunchEnv, check_nproc, detect_env, first_slurm_host, job_port, launched,
                              local_device, restart_store_warning)


def test_plain_process_is_a_world_of_one():
    env = detect_env({})
    assert (env.launcher, env.rank, env.world_size) == ("none", 0, 1)


def test_torchrun_environment():
    env = detect_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                      "MASTER_ADDR": "node7", "MASTER_PORT": "1234"})
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("torchrun", 3, 8, 1, 4)
    assert (env.master_addr, env.master_port) == ("node7", 1234)


def test_slurm_environment_takes_the_first_host_as_master():
    env = detect_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
                      "SLURM_JOB_NODELIST": "gpu[03-05,9]", "SLURM_TASKS_PER_NODE": "4(x2)"})
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("slurm", 5, 8, 1, 4)
    assert env.master_addr == "gpu03"
    assert detect_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "MASTER_ADDR": "head", "SLURM_STEP_ID": "1",
                       "SLURM_JOB_NODELIST": "a1,b2"}).master_addr == "head"


@pytest.mark.parametrize("nodelist,first", [("node1", "node1"), ("cn[001-004]", "cn001"),
                                            ("a[7,9],b1", "a7"), ("x-1,y", "x-1"),
                                            ("node-[001-004]-ib", "node-001-ib"), ("rack[1-2]-n[01-04]", "rack1-n01"),
                                            ("a,b[1-3]", "a"), ("gpu[03-05,9],cpu1", "gpu03")])
def test_slurm_host_lists(nodelist, first):
    assert first_slurm_host(nodelist) == first


# Every documented form of SLURM's host lists (man scontrol, "hostlist expression"), expanded in
# the order `scontrol show hostnames` prints them (the cases it was run on are in the comments).
HOSTLISTS = [
    ("node1", ["node1"]),
    ("cn[001-003]", ["cn001", "cn002", "cn003"]),
    ("node-[001-003]-ib", ["node-001-ib", "node-002-ib", "node-003-ib"]),               # suffix after the range
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),      # two ranges: their product
    ("a,b[1-3]", ["a", "b1", "b2", "b3"]),                                               # a list of items
    ("gpu[03-04,9],cpu1", ["gpu03", "gpu04", "gpu9", "cpu1"]),                          # a list inside the brackets
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),                                             # no padding: widths grow
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),                                    # padding kept, then outgrown
]


@pytest.mark.parametrize("nodelist,hosts", HOSTLISTS)
def test_slurm_host_list_expansion(nodelist, hosts):
    from ddtrain.distributed.env import expand_slurm_hostlist
    assert expand_slurm_hostlist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["n[1-", "n]1[", "n[a-b]", "n[1-2", ",", "n[[1]]"])
def test_a_slurm_host_list_that_does_not_parse_is_named(bad):
    from ddtrain.distributed.env import expand_slurm_hostlist
    with pytest.raises(DDTrainError, match="cannot parse SLURM host list"):
        expand_slurm_hostlist(bad)


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


# ---------------------------------------------------------------- issue 17: what real launchers set
BATCH_SHELL = {"SLURM_JOB_ID": "4711", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0",
               "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "n0", "SLURM_JOB_NUM_NODES": "1"}


@pytest.mark.parametrize("step", [None, "4294967294", "4294967295"])
def test_an_sbatch_batch_shell_is_not_an_srun_task(step):
    # sbatch's shell has SLURM_PROCID=0 too; only a job step (srun) has a step id 0, 1, ...
    env = dict(BATCH_SHELL, SLURM_NTASKS="2", **({"SLURM_STEP_ID": step} if step else {}))
    assert detect_env(env).launcher == "none" and detect_env(env).world_size == 1
    assert not launched(env)
    task = dict(env, SLURM_STEP_ID="0", SLURM_PROCID="1", SLURM_LOCALID="1")
    assert launched(task) and (detect_env(task).launcher, detect_env(task).rank, detect_env(task).world_size) == \
        ("slurm", 1, 2)


def test_nproc_that_disagrees_with_slurm_is_refused_in_a_task_and_warned_about_in_a_batch_shell():
    task = dict(BATCH_SHELL, SLURM_NTASKS="2", SLURM_STEP_ID="0")
    with pytest.raises(DDTrainError, match=r"--nproc 4: this process is already rank 0 of 2 started by srun"):
        check_nproc(4, task)
    assert check_nproc(1, task) is None and check_nproc(2, task) is None
    warning = check_nproc(2, BATCH_SHELL)     # the case: --ntasks=1, --nproc 2
    assert "SLURM_NTASKS=1" in warning and "--nproc 2 starts 2 worker(s)" in warning
    assert check_nproc(2, dict(BATCH_SHELL, SLURM_NTASKS="2")) is None
    assert check_nproc(4, {}) is None   # no SLURM, nothing to disagree with


def test_the_port_comes_from_the_job_id_so_two_jobs_on_a_node_do_not_collide():
    a = detect_env(dict(BATCH_SHELL, SLURM_STEP_ID="0", SLURM_JOB_ID="4711"))
    b = detect_env(dict(BATCH_SHELL, SLURM_STEP_ID="0", SLURM_JOB_ID="4712"))
    assert a.master_port != b.master_port and a.job_id == "4711"
    assert all(10000 <= p < 32768 for p in (a.master_port, b.master_port))  # below Linux's ephemeral ports
    assert detect_env(dict(BATCH_SHELL, SLURM_STEP_ID="0", MASTER_PORT="1234")).master_port == 1234
    ompi = detect_env({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
                       "OMPI_MCA_ess_base_jobid": "655032321"})
    assert ompi.master_port == job_port("655032321") != DEFAULT_PORT


def _env(local_rank, local_world, launcher="slurm"):
    return LaunchEnv(launcher, local_rank, local_world, local_rank, local_world, "127.0.0.1", 29500)


def test_one_gpu_per_task_is_cuda0_with_nccl_and_all_gpus_per_node_is_cuda_local_rank():
    # srun --ntasks-per-node=4 --gpus-per-task=1: each task sees one GPU, its own
    assert local_device(_env(2, 4), 1, visible="2") == ("nccl", 0)
    assert local_device(_env(2, 4), 1, requested="nccl", visible="2") == ("nccl", 0)
    assert local_device(_env(2, 4), 4, visible="0,1,2,3") == ("nccl", 2)    # one launcher per node
    assert local_device(_env(0, 4), 0) == ("gloo", None)                    # a CPU node
    assert local_device(_env(2, 4), 2, visible="0,1") == ("gloo", None)      # too few GPUs to share out
    with pytest.raises(DDTrainError, match="local rank 2 of 4 on this node sees 2 GPU"):
        local_device(_env(2, 4), 2, requested="nccl", visible="0,1")
    assert local_device(_env(0, 1, "none"), 1) == ("gloo", 0)               # a world of one uses its GPU


def test_runtime_init_maps_one_visible_gpu_per_task_to_cuda0(monkeypatch):
    # the srun --gpus-per-task=1 case, through runtime.init with CUDA faked (no GPU here)
    import torch
    import torch.distributed as dist
    from ddtrain.distributed import runtime
    monkeypatch.setattr(runtime, "_state", None)
    for name, value in (("is_available", lambda: True), ("device_count", lambda: 1), ("set_device", lambda d: None)):
        monkeypatch.setattr(torch.cuda, name, value)
    captured = {}
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: captured.update(kw))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    for key in ("RANK", "WORLD_SIZE", "DDTRAIN_BACKEND", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in dict(BATCH_SHELL, SLURM_STEP_ID="0", SLURM_PROCID="2", SLURM_LOCALID="2", SLURM_NTASKS="4",
                           SLURM_TASKS_PER_NODE="4", CUDA_VISIBLE_DEVICES="2").items():
        monkeypatch.setenv(key, value)
    runtime.init()
    assert captured["backend"] == "nccl" and captured["device_id"] == torch.device("cuda", 0)
    assert runtime.device() == torch.device("cuda", 0)
    monkeypatch.setattr(runtime, "_state", None)


def test_a_plain_torchrun_with_restarts_and_a_shared_store_is_warned_about():
    worker = {"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in restart_store_warning(worker)
    assert restart_store_warning(dict(worker, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")) is None
    assert restart_store_warning(dict(worker, TORCHELASTIC_MAX_RESTARTS="0")) is None
