"""What a checkpoint describes: where training stands and which live objects it captures.

The heavy lifting (torch.distributed.checkpoint) lives in `tensors.py`, imported only when a
checkpoint is actually written or read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Position:
    """Where training stands: `step` optimizer steps done, `step - epoch * steps_per_epoch` of them in
    the current epoch."""

    step: int
    epoch: int
    # fp16: steps GradScaler skipped that the LR schedule has not yet taken back (it does so at log
    # steps); a resume must take them back at the same log step as the run it continues.
    unscheduled_skips: int = 0


@dataclass
class Parts:
    """The live objects a checkpoint captures."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    rank: int
    world_size: int
    samples_per_step: int  # per rank: data.batch_size × training.grad_accum_steps


def world_size_mismatch(name: str, saved: int, now: int) -> str:
    return (f"checkpoint {name} was written by {saved} processes and this run has {now}; resume with "
            f"{saved} processes (--nproc × --nnodes; the data order depends on it), or start a new run.dir")
