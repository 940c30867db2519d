"""[distributed]: the process group — backend, init method, how long a collective and a step may take.
([parallel] says how the model is spread over the processes, [ddp] how DDP averages gradients.)"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from dtrain.config.section import Section
from dtrain.config.settings import A_YEAR, setting
from dtrain.errors import ConfigError


@dataclass(slots=True)
class DistributedConfig(Section):
    backend: Literal["auto", "nccl", "gloo"] = setting(
        "auto", "auto picks nccl when CUDA GPUs are visible, gloo otherwise."
    )
    init_method: str = setting(
        "env://", "env:// (torchrun, SLURM, Open MPI set it up), tcp://host:port or file:///shared/path."
    )
    timeout_s: float = setting(
        1800.0,
        "Seconds a collective may wait before the backend gives up (at least 5: "
        "setting up the group alone takes a moment).",
        min=5,
        max=A_YEAR,
    )
    hang_timeout_s: float = setting(
        300.0,
        "Seconds without any rank finishing a step before every rank "
        "writes its Python stacks to run.dir/diagnostics and the job ends "
        "naming the ranks behind (0: off). Keep it below timeout_s.",
        min=0,
        max=A_YEAR,
    )

    def check(self) -> None:
        scheme = self.init_method.split("://", 1)[0]
        if "://" not in self.init_method or scheme not in ("env", "tcp", "file"):
            raise ConfigError(
                f"distributed.init_method = '{self.init_method}' is not "
                f"supported; use env://, tcp://host:port or file:///path"
            )
        problem = _init_method_problem(self.init_method)
        if problem:
            raise ConfigError(f"distributed.init_method = '{self.init_method}' {problem}")
        hang, timeout = self.hang_timeout_s, self.timeout_s
        if 0 < hang < 1:
            raise ConfigError(
                f"distributed.hang_timeout_s = {hang:g} would call every step a hang; use 0 (off) or at least 1 second"
            )
        if hang and hang >= timeout:
            raise ConfigError(
                f"distributed.hang_timeout_s = {hang:g} must be below distributed.timeout_s = "
                f"{timeout:g}, or the backend gives up first and the hang goes unexplained"
            )


def _init_method_problem(url: str) -> str | None:
    """What torch could not use in a tcp:// or file:// init method (it would fail in every worker, or
    wait for a file that can never be made), or None."""
    scheme, rest = url.split("://", 1)
    if scheme == "tcp":
        host, _, port = rest.split("/", 1)[0].rpartition(":")
        if not port.isdigit() or not 0 < int(port) < 65536:
            return "needs a port: tcp://host:port (1-65535)"
        if not host.strip("[]"):
            return "needs a host: tcp://host:port (rank 0's address)"
    if scheme == "file":
        path = rest.split("?", 1)[0]
        if not path.startswith("/") or path == "/":
            return "needs an absolute file path on a shared file system: file:///shared/path/rendezvous"
        if not os.path.isdir(os.path.dirname(path)):
            return (
                f"names a file in {os.path.dirname(path)}, which is not a folder here; use a folder every node shares"
            )
    return None
