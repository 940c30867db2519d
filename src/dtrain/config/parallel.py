"""[parallel]: how the model is spread over the processes — the strategy (DDP, FSDP, HSDP) and the mesh's
tensor, pipeline and context parallel sizes, with the pipeline's schedule and split."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dtrain.config.section import Section
from dtrain.config.settings import setting
from dtrain.errors import ConfigError


@dataclass(slots=True)
class ParallelConfig(Section):
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

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages each process holds: pp_stages_per_rank, or its default for the schedule."""
        return self.pp_stages_per_rank or (2 if self.pp_schedule == "interleaved_1f1b" else 1)

    def check(self) -> None:
        if self.pp_stages_per_rank == 1 and self.pp_schedule == "interleaved_1f1b":
            raise ConfigError(
                "parallel.pp_schedule = 'interleaved_1f1b' interleaves several stages per process; "
                "set parallel.pp_stages_per_rank to 2 or more (or 0: 2)"
            )
        if self.pp_stages_per_rank > 1 and self.pp_schedule != "interleaved_1f1b":
            raise ConfigError(
                f"parallel.pp_stages_per_rank = {self.pp_stages_per_rank} needs parallel.pp_schedule = "
                f"'interleaved_1f1b' ('{self.pp_schedule}' runs one stage per process); set it to 1"
            )
