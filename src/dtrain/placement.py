"""Where this process sits in the job, read from whoever started it: torchrun (and anything that sets the
env:// variables, such as a Kubernetes PyTorchJob), SLURM's `srun`, or Open MPI's `mpirun` — and whether
this is a later attempt of a run (torchrun's restart, SLURM's requeue). Everything else in dtrain asks
this module, never the environment directly. It imports no torch: the command line asks it before torch
is imported (distributed/ re-exports it)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from dtrain.errors import EnvironmentProblem


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    launcher: str = "single"  # torchrun | slurm | mpi | single

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def torchrun_run_id(environ: Mapping[str, str] = os.environ) -> str | None:
    """The run id torchrun's agent gives its workers (--rdzv-id), or None outside torchrun."""
    return environ.get("TORCHELASTIC_RUN_ID")


def is_torchrun_worker(environ: Mapping[str, str] = os.environ) -> bool:
    """True when torchrun's agent started this process as one of its workers (it has formed the group's
    rendezvous already, and restarts the group on a failure)."""
    return torchrun_run_id(environ) is not None


def in_worker_environment(environ: Mapping[str, str] = os.environ) -> bool:
    """True when a launcher (torchrun, srun, mpirun) already started this process as one of many."""
    return detect_env(environ).launcher != "single"


def detect_env(environ: Mapping[str, str] = os.environ) -> DistEnv:
    """Read rank, world size and rendezvous address from torchrun, SLURM or Open MPI variables."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return _possible(
            DistEnv(
                rank=_int(environ, "RANK"),
                world_size=_int(environ, "WORLD_SIZE"),
                local_rank=_int(environ, "LOCAL_RANK", 0),
                local_world_size=_int(environ, "LOCAL_WORLD_SIZE", 1),
                master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
                master_port=_int(environ, "MASTER_PORT", 29500),
                launcher="torchrun",
            ),
            "RANK",
            "WORLD_SIZE",
            local_names=("LOCAL_RANK", "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ else None,
        )
    # `srun` sets SLURM_STEP_ID for each task it starts; a batch script or salloc shell does not, so
    # a plain `dtrain run` there launches torchrun instead of waiting for peers that never come.
    if "SLURM_STEP_ID" in environ and "SLURM_PROCID" in environ and _int(environ, "SLURM_NTASKS", 1) > 1:
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "")
        job_id = _int(environ, "SLURM_JOB_ID", 0)
        return _possible(
            DistEnv(
                rank=_int(environ, "SLURM_PROCID"),
                world_size=_int(environ, "SLURM_NTASKS"),
                local_rank=_int(environ, "SLURM_LOCALID", 0),
                local_world_size=_slurm_tasks_on_node(environ),
                master_addr=environ.get("MASTER_ADDR") or first_slurm_host(nodelist) or "127.0.0.1",
                # A port derived from the job id lets two jobs share a node without colliding.
                master_port=_int(environ, "MASTER_PORT", 15000 + job_id % 20000),
                launcher="slurm",
            ),
            "SLURM_PROCID",
            "SLURM_NTASKS",
            local_names=("SLURM_LOCALID", "the node's task count"),
        )
    if "OMPI_COMM_WORLD_RANK" in environ and "OMPI_COMM_WORLD_SIZE" in environ:
        world = _int(environ, "OMPI_COMM_WORLD_SIZE")
        local_world = _int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE", 1)
        if "MASTER_ADDR" not in environ and local_world != world:
            raise EnvironmentProblem(
                "mpirun across nodes needs MASTER_ADDR (rank 0's host): add "
                "`-x MASTER_ADDR=<host> -x MASTER_PORT=<port>` to the mpirun command"
            )
        return _possible(
            DistEnv(
                rank=_int(environ, "OMPI_COMM_WORLD_RANK"),
                world_size=world,
                local_rank=_int(environ, "OMPI_COMM_WORLD_LOCAL_RANK", 0),
                local_world_size=local_world,
                master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
                master_port=_int(environ, "MASTER_PORT", 29500),
                launcher="mpi",
            ),
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            local_names=("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
        )
    return DistEnv()


def _possible(env: DistEnv, rank_name: str, world_name: str, local_names: tuple[str, str] | None = None) -> DistEnv:
    """Refuse at once a place no group can have (it would otherwise wait for peers that never come
    until distributed.timeout_s)."""
    if env.world_size < 1 or not 0 <= env.rank < env.world_size:
        raise EnvironmentProblem(
            f"{rank_name}={env.rank} with {world_name}={env.world_size} is impossible: a rank "
            f"is 0..{world_name}-1; check what sets them (the launcher, the pod spec)"
        )
    if local_names and (
        not 0 <= env.local_rank < max(env.local_world_size, 1) or env.local_world_size > env.world_size
    ):
        local_rank, local_world = local_names
        raise EnvironmentProblem(
            f"{local_rank}={env.local_rank} with {local_world}={env.local_world_size} and "
            f"{world_name}={env.world_size} is impossible; check what sets them"
        )
    if not 0 < env.master_port < 65536:
        raise EnvironmentProblem(f"MASTER_PORT={env.master_port} is not a TCP port (1-65535)")
    return env


def first_slurm_host(nodelist: str) -> str | None:
    """The first host of a SLURM node list such as 'gpu[003-005,010],cpu01' (here: 'gpu003')."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        return None
    prefix, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _slurm_tasks_on_node(environ: Mapping[str, str]) -> int:
    # SLURM_STEP_TASKS_PER_NODE looks like '4(x2),3': per-node counts in node order.
    spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE", "1")
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m:
            counts += [int(m.group(1))] * int(m.group(2) or 1)
    node = _int(environ, "SLURM_NODEID", 0)
    return counts[node] if node < len(counts) else 1


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = environ.get(name)
    if value is None:
        if default is None:
            raise EnvironmentProblem(f"environment variable {name} is not set")
        return default
    try:
        number = int(value)
    except ValueError:
        raise EnvironmentProblem(f"environment variable {name}={value!r} is not an integer") from None
    if not -(2**31) <= number < 2**31:  # ranks, sizes, ports and job ids all fit; torch's store takes int32
        raise EnvironmentProblem(f"environment variable {name}={value} is beyond any job's numbers; check what sets it")
    return number


# --- attempts ----------------------------------------------------------------------------------------


_RESTARTS = {"torchrun": "TORCHELASTIC_RESTART_COUNT", "SLURM": "SLURM_RESTART_COUNT"}


def restarts(environ: Mapping[str, str] = os.environ) -> dict[str, int]:
    """How often this run has been started again, by whom: torchrun's restarts of the worker group and
    SLURM's requeues of the job (0 on the first attempt). A value that is not a count reads as 0."""
    values = {who: environ.get(name, "0").strip() for who, name in _RESTARTS.items()}
    return {who: int(value) if value.isdigit() else 0 for who, value in values.items()}


def restart_count(environ: Mapping[str, str] = os.environ) -> int:
    """Restarts and requeues together: 0 on a run's first attempt."""
    return sum(restarts(environ).values())


def later_attempt(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this is a restart of a run that already started (torchrun's restart, SLURM's requeue):
    it resumes, and replaces its first attempt's outputs."""
    return restart_count(environ) > 0


def describe_attempt(world_size: int, environ: Mapping[str, str] = os.environ) -> str | None:
    """The console's line for a later attempt (the agents' own account of it is silenced), or None."""
    counts = restarts(environ)
    said = []
    if counts["torchrun"]:
        said.append(
            f"restart {counts['torchrun']} of at most {environ.get('TORCHELASTIC_MAX_RESTARTS', '?')} "
            f"(torchrun): a process of the group failed or a node left"
        )
    if counts["SLURM"]:
        said.append(f"requeue {counts['SLURM']} of this SLURM job")
    if not said:
        return None
    return "; ".join(said) + f"; the group re-formed with {world_size} process(es)"
