"""The process group of one worker: backend, device and threads, then init and destroy — and the
debug level, the flight recorder and gloo's settling that go with them."""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from dtrain.config import DistributedConfig
from dtrain.distributed.lifecycle import die_with_the_launcher
from dtrain.distributed.waiting import WaitReport, wait_for_rank0
from dtrain.errors import ConfigError, EnvironmentProblem, PeersMissing
from dtrain.placement import DistEnv, detect_env, is_torchrun_worker

# --- backend and device ---------------------------------------------------------------------------


def uses_cuda(device: str = "auto") -> bool:
    """Whether the workers compute on GPUs: training.device = auto takes them where CUDA sees any, cpu
    never does (a GPU machine kept for something else, a CPU baseline), cuda refuses to start without."""
    if device == "cpu":
        return False
    has_cuda = torch.cuda.is_available()
    if device == "cuda" and not has_cuda:
        raise ConfigError(
            "training.device = 'cuda' needs CUDA GPUs and this process sees none; use training.device=auto or cpu"
        )
    return has_cuda


def keep_to_the_cpu(device: str, environ: MutableMapping[str, str] = os.environ) -> None:
    """training.device = cpu, applied by the launcher before it or its workers look at CUDA: with the
    GPUs hidden, every part that asks (the launcher's GPU count, torch, libraries in the user's model)
    sees a CPU machine."""
    if device == "cpu":
        environ["CUDA_VISIBLE_DEVICES"] = ""


def resolve_backend(requested: str, device: str = "auto") -> str:
    """'auto' is nccl with CUDA GPUs and gloo without; nccl without GPUs is refused."""
    has_cuda = uses_cuda(device)
    if requested == "auto":
        return "nccl" if has_cuda else "gloo"
    if requested == "nccl" and not has_cuda:
        why = "training.device = 'cpu'" if device == "cpu" else "this machine has none"
        raise ConfigError(
            f"distributed.backend = 'nccl' needs CUDA GPUs and {why}; use distributed.backend=gloo (or auto)"
        )
    return requested


def device_index(local_rank: int, visible: int) -> int:
    """The GPU a worker binds among those it sees: its own when it sees one per local rank, the only
    one when it was given exactly one (srun --gpus-per-task=1, per-rank CUDA_VISIBLE_DEVICES)."""
    if visible < 1:
        raise EnvironmentProblem(
            "this worker sees no GPU (CUDA_VISIBLE_DEVICES hides them all?); give "
            "every worker at least one GPU, or use distributed.backend=gloo"
        )
    return local_rank % visible


def bind_device(env: DistEnv, device: str = "auto") -> torch.device:
    """Each process computes on its own GPU (LOCAL_RANK) when there are GPUs, else on the CPU."""
    if uses_cuda(device):
        gpu = torch.device("cuda", device_index(env.local_rank, torch.cuda.device_count()))
        torch.cuda.set_device(gpu)
        return gpu
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

# Ranks started together meet within a second or two (each imports torch first); a rank 0 still
# waiting after this long waits for something.
JOIN_FIRST_LINE_S = 5.0


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
    device: str = "auto",
) -> Session:
    """Join (or create) the process group for this worker and bind its device and threads.

    `debug` turns on torch's distributed debug mode (see `set_debug_level`). The flight recorder keeps
    the last collectives; with nccl, its timeout dump goes under `diagnostics_dir`.
    """
    die_with_the_launcher()
    if dist.is_available() and dist.is_initialized():
        env = _env_from_group(detect_env(environ))
        backend = str(dist.get_backend())
        if backend == "gloo":
            _let_gloo_settle_at_exit()
        set_debug_level(debug, backend)
        return Session(env, backend, bind_device(env, device), owns_group=False)

    env = detect_env(environ)
    backend = resolve_backend(config.backend, device)
    set_debug_level(debug, backend)
    bound = bind_device(env, device)
    if bound.type == "cpu":
        set_cpu_threads(env, environ)
    if env.world_size == 1:
        return Session(env, backend, bound, owns_group=False)

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
        if not is_torchrun_worker(environ):  # torchrun's agent formed the group before starting us
            # A rank other than 0 first waits for rank 0's store, saying so: torch would wait silently and
            # end in C++ frames and a traceback (a pod started before, or without, its rank 0).
            wait_for_rank0(env, config.timeout_s)
    where = f"{env.master_addr}:{env.master_port}" if init_method == "env://" else init_method
    try:
        with _joining_report(env, where, config.timeout_s):
            dist.init_process_group(
                backend=backend,
                init_method=init_method,
                rank=env.rank,
                world_size=env.world_size,
                timeout=datetime.timedelta(seconds=config.timeout_s),
                # Binding the device up front lets nccl create its communicator eagerly and correctly.
                device_id=bound if backend == "nccl" else None,
            )
    except (dist.DistStoreError, dist.DistNetworkError) as exc:  # torch's own words ("1/2 clients joined")
        said = (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(".")
        if env.rank == 0 and isinstance(exc, dist.DistNetworkError):  # its store could not listen
            raise EnvironmentProblem(
                f"rank 0 could not serve the rendezvous at {where} ({said}): give a MASTER_PORT nothing "
                f"else on this machine uses"
            ) from None
        raise PeersMissing(
            f"rank {env.rank}: the {env.world_size} ranks did not meet at {where} within "
            f"{config.timeout_s:g} s ({said}): start every rank, or raise distributed.timeout_s"
        ) from None
    if backend == "gloo":
        _let_gloo_settle_at_exit()
    return Session(env, backend, bound, owns_group=True)


def _joining_report(env: DistEnv, where: str, timeout_s: float) -> WaitReport | contextlib.nullcontext:
    """Rank 0 says, once a few seconds went by, that it waits for the others (one of them may still be
    importing torch, or never started); the other ranks stay quiet so the node says it once. torch
    keeps the count of ranks joined inside its store, out of reach until it gives up."""
    if env.rank != 0:
        return contextlib.nullcontext()
    deadline = time.monotonic() + timeout_s

    def line() -> str:
        left = deadline - time.monotonic()
        if left < 1:  # torch gives up a moment after the deadline, and says so
            return ""
        return (
            f"rank 0: waiting for the other ranks to join at {where} ({env.world_size} in all), "
            f"giving up in {left:.0f} s (distributed.timeout_s)"
        )

    return WaitReport(line, first_s=JOIN_FIRST_LINE_S)


def stop(session: Session, together: bool = False) -> None:
    """Destroy the process group if this session made it. `together`: every rank got here in step (a
    run that ended normally, or an agreed stop), so one more collective is safe — also in a group the
    user's script made, which may end the moment fit() returns."""
    if not dist.is_initialized():
        return
    if together and session.backend == "gloo" and session.world_size > 1:
        _let_gloo_settle()
    if session.owns_group:
        if session.backend == "gloo":
            _keep_until_exit(dist.distributed_c10d._world.pg_map)
        dist.destroy_process_group()


# gloo groups destroyed by `stop`, still held here so that their destructor never runs while Python
# runs: see _keep_until_exit.
_destroyed_but_held: list[object] = []


def _keep_until_exit(groups: Iterable[object]) -> None:
    """Hold the gloo groups past destroy_process_group, until the process ends. DDP (and FSDP's mesh)
    hold them too; whoever drops the last holder runs the group's destructor, which joins gloo's
    threads — on the main thread, with the GIL held — while one of those threads may wait for the GIL
    to drop a finished collective's tensors: a finished run that never exits (seen about once in 60
    runs of a Hugging Face model on a busy machine). Held here, the destructor is left to the end of
    the process (a worker ends with os._exit: distributed.end_worker_process), after the settling."""
    _destroyed_but_held.extend(groups)


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
    use_count = probe._use_count  # type: ignore[attr-defined]  # torch's own count of the tensor's holders
    while use_count() > 1 and time.monotonic() < deadline:
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
