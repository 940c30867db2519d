"""Inside a worker: who am I, which backend, which device — then init and destroy the process group.

`dtrain.placement` (torch-free, below this package) reads the place from the launcher's variables,
`group` owns the process group, `collectives` the small object collectives, `lifecycle` how a worker
lives and leaves under its launcher, `failures` how it says that it failed. The names are re-exported
here: `distributed.start`, `distributed.barrier`, ...
"""

from dtrain.distributed.collectives import (
    barrier,
    every_rank_raises,
    first_error,
    from_rank0,
    gather_objects,
    hostnames,
    rank0_decides,
)
from dtrain.distributed.group import (
    Session,
    available_cores,
    bind_device,
    device_index,
    enable_flight_recorder,
    keep_to_the_cpu,
    resolve_backend,
    session,
    set_cpu_threads,
    set_debug_level,
    start,
    stop,
)
from dtrain.distributed.lifecycle import LAUNCHED_BY_DTRAIN, die_with_the_launcher, end_worker_process
from dtrain.placement import (
    DistEnv,
    describe_attempt,
    detect_env,
    first_slurm_host,
    in_worker_environment,
    is_torchrun_worker,
    later_attempt,
    restart_count,
)

__all__ = [
    "LAUNCHED_BY_DTRAIN",
    "DistEnv",
    "Session",
    "available_cores",
    "barrier",
    "bind_device",
    "describe_attempt",
    "detect_env",
    "device_index",
    "die_with_the_launcher",
    "enable_flight_recorder",
    "end_worker_process",
    "every_rank_raises",
    "first_error",
    "first_slurm_host",
    "from_rank0",
    "gather_objects",
    "hostnames",
    "in_worker_environment",
    "is_torchrun_worker",
    "keep_to_the_cpu",
    "later_attempt",
    "rank0_decides",
    "resolve_backend",
    "restart_count",
    "session",
    "set_cpu_threads",
    "set_debug_level",
    "start",
    "stop",
]
