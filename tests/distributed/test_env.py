"""A worker finds its place from torchrun, SLURM or Open MPI variables; backend and threads follow."""

import pytest
import torch

from dtrain import distributed
from dtrain.distributed import DistEnv, detect_env, first_slurm_host
from dtrain.errors import ConfigError, EnvironmentProblem


def test_torchrun_variables():
    env = detect_env(
        {
            "RANK": "3",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29400",
        }
    )
    assert env == DistEnv(3, 8, 1, 4, "10.0.0.1", 29400, "torchrun")


def test_srun_task_variables():
    env = detect_env(
        {
            "SLURM_STEP_ID": "0",
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "8",
            "SLURM_LOCALID": "1",
            "SLURM_NODEID": "1",
            "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
            "SLURM_JOB_ID": "4242",
            "SLURM_STEP_NODELIST": "gpu[007-008]",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)
    assert env.master_addr == "gpu007"
    assert env.master_port == 15000 + 4242 % 20000
    assert env.launcher == "slurm"


def test_a_batch_script_without_srun_is_not_a_worker():
    # sbatch/salloc shells carry SLURM_* too, but no step id: dtrain must launch, not wait for peers.
    env = detect_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "1"})
    assert env.launcher == "single" and env.world_size == 1


@pytest.mark.parametrize(
    "nodelist, first",
    [("node01", "node01"), ("gpu[003-005,010]", "gpu003"), ("a[1,3],b7", "a1"), ("host-a,host-b", "host-a")],
)
def test_slurm_nodelist(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_open_mpi_variables():
    env = detect_env(
        {
            "OMPI_COMM_WORLD_RANK": "1",
            "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.launcher) == (1, 2, 1, "127.0.0.1", "mpi")
    with pytest.raises(EnvironmentProblem, match="MASTER_ADDR"):
        detect_env({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})


def test_no_launcher_is_one_process():
    assert detect_env({}) == DistEnv()
    with pytest.raises(EnvironmentProblem, match="RANK='x' is not an integer"):
        detect_env({"RANK": "x", "WORLD_SIZE": "2"})


@pytest.mark.machine_kind
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine-without-GPU answer")
def test_backend_choice_without_gpus():
    assert distributed.resolve_backend("auto") == "gloo"
    assert distributed.resolve_backend("gloo") == "gloo"
    with pytest.raises(ConfigError, match="distributed.backend = 'nccl' needs CUDA GPUs"):
        distributed.resolve_backend("nccl")


def test_training_device_cpu_hides_the_gpus_and_takes_gloo():
    """training.device = cpu on any machine: gloo, the CPU, and the launcher hides the GPUs from itself and
    its workers (CUDA_VISIBLE_DEVICES empty), so nothing in them binds a GPU."""
    assert distributed.resolve_backend("auto", "cpu") == "gloo"
    assert distributed.bind_device(DistEnv(), "cpu") == torch.device("cpu")
    environ = {"CUDA_VISIBLE_DEVICES": "0,1"}
    distributed.keep_to_the_cpu("auto", environ)
    assert environ == {"CUDA_VISIBLE_DEVICES": "0,1"}
    distributed.keep_to_the_cpu("cpu", environ)
    assert environ == {"CUDA_VISIBLE_DEVICES": ""}


def test_cpu_threads_split_the_cores_unless_omp_num_threads_is_set():
    before = torch.get_num_threads()
    try:
        cores = distributed.available_cores()
        two_local = DistEnv(world_size=2, local_world_size=2)
        assert distributed.set_cpu_threads(two_local, environ={}) == max(1, cores // 2)
        assert torch.get_num_threads() == max(1, cores // 2)
        torch.set_num_threads(1)
        assert distributed.set_cpu_threads(two_local, environ={"OMP_NUM_THREADS": "1"}) == 1
    finally:
        torch.set_num_threads(before)
