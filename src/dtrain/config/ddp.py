"""[ddp]: DistributedDataParallel's own knobs — its gradient buckets, its graph, and how the gradients are
averaged (shared memory on one CPU machine, a compressing comm hook)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dtrain.config.section import Section
from dtrain.config.settings import setting


@dataclass(slots=True)
class DDPConfig(Section):
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
