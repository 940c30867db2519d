"""[distributed]: the process group — backend, init method, how long a collective and a step may take."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from dtrain.config.section import Section
from dtrain.config.settings import A_YEAR, setting
from dtrain.errors import ConfigError


@dataclass(slots=True)
class DistributedConfig(Section):
    strategy: Literal["ddp", "fsdp", "hsdp"] = setting(
        "ddp",
        "ddp: every process holds the whole model. fsdp: parameters, gradients and optimizer state "
        "sharded over the processes (FSDP2). hsdp: sharded within a node, replicated across nodes.",
    )
    reshard_after_forward: bool = setting(
        True, "FSDP: free each unit's gathered parameters after its forward (less memory; gathered again for backward)."
    )
    fsdp_cpu_offload: bool = setting(
        False, "FSDP on GPUs: keep parameters, gradients and optimizer state on the CPU between uses."
    )
    hsdp_shard_size: int = setting(
        0,
        "hsdp: processes per shard group (0: the data-parallel processes of one node, of one pipeline stage).",
        min=0,
        max=2**20,
    )
    tp_size: int = setting(
        1,
        "Tensor parallel: processes each layer's weights are split over (inside one node; 1: off). "
        "The data-parallel processes are the world divided by tp_size × pp_size × cp_size.",
        min=1,
        max=2**20,
    )
    pp_size: int = setting(
        1,
        "Pipeline parallel: stages the model's blocks are split into, one group of processes each (1: off).",
        min=1,
        max=2**20,
    )
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = setting(
        "1f1b",
        "Pipeline schedule over the step's micro-batches (training.grad_accum_steps, at least pp_size): "
        "gpipe, 1f1b, or interleaved_1f1b (pp_stages_per_rank stages per process).",
    )
    pp_stages_per_rank: int = setting(
        0, "Pipeline stages each process holds (0: 2 under interleaved_1f1b, else 1).", min=0, max=2**10
    )
    pp_split: Literal["cost", "count"] = setting(
        "cost",
        "How the blocks are cut into pipeline stages: cost (about equal multiply-adds a stage: the head's "
        "stage takes fewer blocks) or count (equal numbers of blocks: closer in memory where the embedding is big).",
    )
    cp_size: int = setting(
        1,
        "Context parallel on CUDA GPUs: processes each sequence is split over (torch's context_parallel; 1: off).",
        min=1,
        max=2**20,
    )
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
    bucket_cap_mb: float = setting(25.0, "DDP gradient bucket size in MiB.", above=0, max=2**20)
    gradient_as_bucket_view: bool = setting(True, "Let gradients alias DDP's buckets (saves a copy and memory).")
    static_graph: bool = setting(False, "Tell DDP the graph is the same every step (enables optimisations).")
    find_unused_parameters: bool = setting(
        False, "Let DDP handle parameters the forward pass does not use (costs a graph walk per step)."
    )
    shared_memory_allreduce: bool = setting(
        True,
        "On CPU, average the gradients of processes on one "
        "machine through shared memory instead of gloo's loopback "
        "TCP (same numbers, less time).",
    )
    comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = setting(
        "none",
        "Compress gradients before DDP's all-reduce with torch's own comm hook: fp16, bf16 "
        "(nccl only) — half the bytes — or powersgd (low-rank; its error-feedback state is not "
        "checkpointed). none: DDP's plain all-reduce (on CPU, the shared-memory average).",
    )

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages each process holds: pp_stages_per_rank, or its default for the schedule."""
        return self.pp_stages_per_rank or (2 if self.pp_schedule == "interleaved_1f1b" else 1)

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
        if self.pp_stages_per_rank == 1 and self.pp_schedule == "interleaved_1f1b":
            raise ConfigError(
                "distributed.pp_schedule = 'interleaved_1f1b' interleaves several stages per process; "
                "set distributed.pp_stages_per_rank to 2 or more (or 0: 2)"
            )
        if self.pp_stages_per_rank > 1 and self.pp_schedule != "interleaved_1f1b":
            raise ConfigError(
                f"distributed.pp_stages_per_rank = {self.pp_stages_per_rank} needs distributed.pp_schedule = "
                f"'interleaved_1f1b' ('{self.pp_schedule}' runs one stage per process); set it to 1"
            )
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
