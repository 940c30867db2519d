"""Optimizer and learning-rate schedule, built in each process after the model is wrapped."""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

from dtrain.config import OptimizerConfig, SchedulerConfig, TrainingConfig

_CPU = torch.device("cpu")


def build_optimizer(
    config: OptimizerConfig, params: Iterable[torch.nn.Parameter], device: torch.device = _CPU
) -> torch.optim.Optimizer:
    options = implementation_options(config.name, device)
    if config.name == "sgd":
        return torch.optim.SGD(
            params,
            lr=config.lr,
            momentum=config.momentum,
            nesterov=config.nesterov,
            weight_decay=config.weight_decay,
            **options,
        )
    return torch.optim.AdamW(
        params,
        lr=config.lr,
        betas=(config.betas[0], config.betas[1]),
        eps=config.eps,
        weight_decay=config.weight_decay,
        **options,
    )


def implementation_options(name: str, device: torch.device) -> dict[str, bool]:
    """AdamW on CUDA uses torch's fused kernel: one launch for all parameters, faster than the default
    multi-tensor path, and GradScaler hands it its inf check on the device, where the other paths
    read it on the host every step. SGD is never fused: torch's fused SGD fills its momentum buffers
    with uninitialised memory on a step GradScaler skips. Elsewhere torch's default (the CPU numbers
    stay those of a plain torch.optim loop, which the parity tests compare against)."""
    if name == "adamw" and device.type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters:
        return {"fused": True}
    return {}


class LRShape:
    """The multiplier of the peak learning rate at each optimizer step: linear warm-up, then
    constant, cosine or linear decay to `min_lr_ratio` at `total_steps`.

    A plain object rather than a lambda so that the scheduler's state stays picklable.
    """

    def __init__(self, config: SchedulerConfig, total_steps: int):
        self.name = config.name
        self.warmup = config.warmup_steps
        self.floor = config.min_lr_ratio
        self.total = max(total_steps, 1)

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.name == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        if self.name == "cosine":
            return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))
        return self.floor + (1 - self.floor) * (1 - progress)


def planned_steps(training: TrainingConfig, steps_per_epoch: int) -> int:
    """The optimizer steps the run plans: `training.epochs`, or fewer where `training.max_steps` says so."""
    steps = training.epochs * steps_per_epoch
    return min(steps, training.max_steps) if training.max_steps else steps


def build_scheduler(config: SchedulerConfig, optimizer: torch.optim.Optimizer, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, LRShape(config, total_steps))
