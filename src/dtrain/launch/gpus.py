"""What the launcher knows about this machine's GPUs, learned without a CUDA context of its own.

The launcher stays alive for the whole run while torchrun's workers train. Asking torch for a GPU's
name or compute capability initialises CUDA in the asking process, and a context there would hold
hundreds of MiB of GPU 0 for as long as the run lasts. So the launcher asks a short-lived child
process instead, once, and only on machines where CUDA is visible at all.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

from dtrain.errors import ConfigError, EnvironmentProblem

_PROBE = """
import json, torch
print(json.dumps([{"name": torch.cuda.get_device_name(i), "capability": list(torch.cuda.get_device_capability(i))}
                  for i in range(torch.cuda.device_count())]))
"""


@dataclass(frozen=True)
class Gpu:
    name: str
    capability: tuple[int, int]


def visible_gpus() -> list[Gpu]:
    """The GPUs this process (and the workers it starts) can see; [] without CUDA."""
    import torch

    if not torch.cuda.is_available():  # reads the device count; creates no context
        return []
    try:
        child = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise EnvironmentProblem(
            "CUDA is visible but listing the GPUs took over 300 s; check the driver with nvidia-smi"
        ) from None
    if child.returncode != 0:
        last = (child.stderr.strip().splitlines() or ["no output"])[-1]
        raise EnvironmentProblem(
            f"CUDA is visible but a process could not use it ({last}); check the "
            f"driver with nvidia-smi, or hide the GPUs with CUDA_VISIBLE_DEVICES="
        )
    return [Gpu(g["name"], tuple(g["capability"])) for g in json.loads(child.stdout)]


def check_device_capacity(backend: str, local_world_size: int, gpus: int) -> None:
    """nccl binds one GPU per process: more local processes than GPUs cannot work.

    Only dtrain's own launcher checks this (preflight), counting the GPUs it sees. A worker started by srun or
    an MPI wrapper may see only the one GPU it was given (CUDA_VISIBLE_DEVICES per task), and that is
    as it should be: it binds that one.
    """
    if backend == "nccl" and local_world_size > gpus:
        raise ConfigError(
            f"--nproc {local_world_size} asks for more nccl processes than this "
            f"machine's {gpus} GPU(s); use --nproc {gpus} or distributed.backend=gloo"
        )
