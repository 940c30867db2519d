"""Inside a worker: who am I, which backend, which device — then init and destroy the process group.

A worker learns its rank and world size from whoever started it: torchrun (and anything that sets the
env:// variables, such as a Kubernetes PyTorchJob), SLURM's `srun`, or Open MPI's `mpirun`. Everything
else in dtrain asks this module, never the environment directly.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import signal
import socket
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from .config import DistributedConfig
from .errors import ConfigError, EnvironmentProblem

# Set by `dtrain run/launch` for the workers it starts (the value: the launcher's pid). Its workers
# leave reporting errors to it, and die with it.
LAUNCHED_BY_DTRAIN = "DTRAIN_LAUNCHED"


def die_with_the_launcher(environ: Mapping[str, str] = os.environ) -> None:
    """Under dtrain's launcher, have the kernel SIGKILL this worker when the launcher dies (Linux's
    PR_SET_PDEATHSIG): a launcher killed with SIGKILL cannot stop its workers, and they would go on
    training under init, writing checkpoints and holding run.dir's lock. torchrun's agent runs
    inside the launcher, so the launcher is this worker's parent."""
    launcher = environ.get(LAUNCHED_BY_DTRAIN, "")
    if not launcher.isdigit() or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != int(launcher):  # it died before the request was in place
        os._exit(128 + signal.SIGKILL)


def end_worker_process(code: int) -> NoReturn:
    """End this worker process with `code` as a normal exit would (atexit handlers run, output
    flushed), but without the interpreter's teardown.

    torch's DistributedDataParallel keeps its process group, and so gloo's worker threads, alive until
    the process ends, even after destroy_process_group. A gloo thread that drops the last tensor of a
    just-finished collective needs the GIL for it; if the interpreter is tearing down by then, the
    thread is killed holding C++ state and the finished run dies with SIGABRT ("terminate called
    without an active exception") or SIGSEGV — reported as a crash, a few percent of runs on a busy
    machine. Leaving with os._exit after the normal exit work avoids that teardown entirely.
    """
    import atexit
    import logging

    atexit._run_exitfuncs()  # what sys.exit would run (trackers, loggers, temporary files)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


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


# --- backend and device ---------------------------------------------------------------------------


def resolve_backend(requested: str) -> str:
    """'auto' is nccl with CUDA GPUs and gloo without; nccl without GPUs is refused."""
    has_cuda = torch.cuda.is_available()
    if requested == "auto":
        return "nccl" if has_cuda else "gloo"
    if requested == "nccl" and not has_cuda:
        raise ConfigError(
            "distributed.backend = 'nccl' needs CUDA GPUs and this machine has none; "
            "use distributed.backend=gloo (or auto)"
        )
    return requested


def check_device_capacity(backend: str, local_world_size: int, gpus: int) -> None:
    """nccl binds one GPU per process: more local processes than GPUs cannot work.

    Only dtrain's own launcher checks this, counting the GPUs it sees. A worker started by srun or
    an MPI wrapper may see only the one GPU it was given (CUDA_VISIBLE_DEVICES per task), and that is
    as it should be: it binds that one.
    """
    if backend == "nccl" and local_world_size > gpus:
        raise ConfigError(
            f"--nproc {local_world_size} asks for more nccl processes than this "
            f"machine's {gpus} GPU(s); use --nproc {gpus} or distributed.backend=gloo"
        )


def device_index(local_rank: int, visible: int) -> int:
    """The GPU a worker binds among those it sees: its own when it sees one per local rank, the only
    one when it was given exactly one (srun --gpus-per-task=1, per-rank CUDA_VISIBLE_DEVICES)."""
    if visible < 1:
        raise EnvironmentProblem(
            "this worker sees no GPU (CUDA_VISIBLE_DEVICES hides them all?); give "
            "every worker at least one GPU, or use distributed.backend=gloo"
        )
    return local_rank % visible


def bind_device(env: DistEnv) -> torch.device:
    """Each process computes on its own GPU (LOCAL_RANK) when there are GPUs, else on the CPU."""
    if torch.cuda.is_available():
        device = torch.device("cuda", device_index(env.local_rank, torch.cuda.device_count()))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def set_cpu_threads(env: DistEnv, environ: Mapping[str, str] = os.environ) -> int:
    """Split the cores among the processes on this node, unless OMP_NUM_THREADS says otherwise.

    Over-subscription is the classic CPU slowdown: two processes with two threads each on two cores
    run at about half speed.
    """
    if "OMP_NUM_THREADS" in environ:
        return torch.get_num_threads()
    threads = max(1, available_cores() // max(1, env.local_world_size))
    torch.set_num_threads(threads)
    return threads


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


# --- the process group ----------------------------------------------------------------------------


@dataclass
class Session:
    """The distributed context of one worker: its place, backend and device."""

    env: DistEnv
    backend: str
    device: torch.device
    owns_group: bool  # this session created the process group and must destroy it

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0


def start(
    config: DistributedConfig,
    environ: Mapping[str, str] = os.environ,
    *,
    debug: bool = False,
    diagnostics_dir: Path | None = None,
) -> Session:
    """Join (or create) the process group for this worker and bind its device and threads.

    `debug` turns on torch's distributed debug mode (see `set_debug_level`). The flight recorder keeps
    the last collectives; with nccl, its timeout dump goes under `diagnostics_dir`.
    """
    die_with_the_launcher()
    if dist.is_available() and dist.is_initialized():
        env = _env_from_group(detect_env(environ))
        backend = dist.get_backend()
        if backend == "gloo":
            _let_gloo_settle_at_exit()
        set_debug_level(debug, backend)
        device = bind_device(env)
        return Session(env, backend, device, owns_group=False)

    env = detect_env(environ)
    backend = resolve_backend(config.backend)
    set_debug_level(debug, backend)
    device = bind_device(env)
    if device.type == "cpu":
        set_cpu_threads(env, environ)
    if env.world_size == 1:
        return Session(env, backend, device, owns_group=False)

    enable_flight_recorder(diagnostics_dir if backend == "nccl" else None)
    init_method = config.init_method
    if init_method == "env://":
        # SLURM and Open MPI do not set the env:// variables; fill them from what they do set.
        for name, value in (
            ("MASTER_ADDR", env.master_addr),
            ("MASTER_PORT", env.master_port),
            ("RANK", env.rank),
            ("WORLD_SIZE", env.world_size),
            ("LOCAL_RANK", env.local_rank),
            ("LOCAL_WORLD_SIZE", env.local_world_size),
        ):
            os.environ.setdefault(name, str(value))
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=config.timeout_s),
        # Binding the device up front lets nccl create its communicator eagerly and correctly.
        device_id=device if backend == "nccl" else None,
    )
    if backend == "gloo":
        _let_gloo_settle_at_exit()
    return Session(env, backend, device, owns_group=True)


def stop(session: Session, together: bool = False) -> None:
    """Destroy the process group if this session made it. `together`: every rank got here in step (a
    run that ended normally, or an agreed stop), so one more collective is safe — also in a group the
    user's script made, which may end the moment fit() returns."""
    if not dist.is_initialized():
        return
    if together and session.backend == "gloo" and session.world_size > 1:
        _let_gloo_settle()
    if session.owns_group:
        dist.destroy_process_group()


_settling_at_exit = False


def _let_gloo_settle_at_exit() -> None:
    """Before the interpreter tears down, give gloo's thread a moment with the GIL free. A script's last
    collective (its own, after fit()) leaves that thread dropping Python tensors just as the main
    thread exits; should it take the GIL once finalisation has begun, Python ends the thread mid-C++
    and the process aborts ("terminate called without an active exception", SIGABRT) after a run that
    succeeded. No collective here: a rank cannot know that the others are exiting too."""
    global _settling_at_exit
    if not _settling_at_exit:
        import atexit
        import time

        atexit.register(time.sleep, 0.05)  # the group may be destroyed already, and still held by DDP
        _settling_at_exit = True


def _let_gloo_settle(limit_s: float = 10.0) -> None:
    """Return once gloo's worker thread has let go of every collective run so far.

    That thread drops a finished collective's tensors after the caller has moved on, and needs the GIL
    to drop a tensor Python made. DDP keeps the process group past destroy_process_group, and when the
    user's script then drops the Trainer, the group's destructor joins that thread while holding the
    GIL: a deadlock (a finished run that never exits). gloo runs its queue in order and drops each
    collective before the next starts, so once the thread has dropped one last collective of our own,
    waited for here with the GIL free, nothing it holds needs the GIL any more."""
    import time

    probe = torch.zeros(1)
    dist.all_reduce(probe)  # holds no earlier collective (a barrier would)
    deadline = time.monotonic() + limit_s
    while probe._use_count() > 1 and time.monotonic() < deadline:
        time.sleep(0.001)


@contextlib.contextmanager
def session(config: DistributedConfig, **options) -> Iterator[Session]:
    """`with session(cfg.distributed) as s:` — the group is destroyed on success and on error."""
    s = start(config, **options)
    try:
        yield s
    finally:
        stop(s)


def set_debug_level(debug: bool, backend: str) -> str | None:
    """TORCH_DISTRIBUTED_DEBUG for this process, set so that torch really uses it: torch reads the
    variable once, when torch.distributed is imported, so it is told again here. DETAIL (every
    collective checked across ranks, DDP's runtime statistics logged) on nccl; INFO on gloo, where
    DDP over DETAIL's checking process-group wrapper dies with SIGSEGV in torch 2.13."""
    if not debug:
        return None
    level = "DETAIL" if backend == "nccl" else "INFO"
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = level
    dist.set_debug_level_from_env()
    return level


def enable_flight_recorder(diagnostics_dir: Path | None) -> None:
    """Keep the last collectives of every process group in torch's flight recorder (nccl, and gloo on
    recent torch), so that a hang can be dumped and read (`HangWatch` dumps it into diagnostics/).

    Current torch reads TORCH_FR_* (and warns about the TORCH_NCCL_* names it replaced); torch
    before 2.7 reads only TORCH_NCCL_*. A value the user set, under either name, wins. With
    `diagnostics_dir` (nccl), nccl's own timeout dump is written there too.
    """
    current = hasattr(torch._C, "_distributed_c10d") and hasattr(torch._C._distributed_c10d, "_dump_fr_trace")
    size, temp_file = (
        ("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE")
        if current
        else ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    )
    if not {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"} & set(os.environ):
        os.environ[size] = "2000"
    # nccl's own watchdog also dumps when a collective times out (distributed.timeout_s).
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    if diagnostics_dir is not None:
        diagnostics_dir.mkdir(parents=True, exist_ok=True)
        if not {"TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"} & set(os.environ):
            os.environ[temp_file] = str(diagnostics_dir / "flight-recorder-rank-")


def _env_from_group(env: DistEnv) -> DistEnv:
    # The user initialised the group themselves: trust it over the environment.
    return DistEnv(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=env.local_rank,
        local_world_size=env.local_world_size,
        master_addr=env.master_addr,
        master_port=env.master_port,
        launcher=env.launcher,
    )


def hostname() -> str:
    return socket.gethostname()


# --- small collectives ----------------------------------------------------------------------------


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks in place (a no-op on one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, by rank (a collective)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    _let_gloo_release_python_objects()
    return gathered


def first_error(error: str | None) -> str | None:
    """Every rank learns the lowest rank's error message, if any rank has one (a collective)."""
    return next((e for e in gather_objects(error) if e is not None), None)


def hostnames() -> list[str]:
    """Every rank's host name, by rank (a collective)."""
    me = socket.gethostname()
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [me]
    names: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(names, me)
    _let_gloo_release_python_objects()
    return names


def from_rank0(value):
    """Rank 0's `value` on every rank (a collective)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    _let_gloo_release_python_objects()
    return box[0]


def _let_gloo_release_python_objects() -> None:
    # gloo's worker threads drop the Python-owned tensors of an object collective after it completes,
    # and need the GIL for that. If the process group were destroyed right then (the main thread
    # joins those threads holding the GIL) both would wait forever. A barrier lets them finish first.
    dist.barrier()
