"""Optimizer and learning-rate schedule, built in each process after the model is wrapped: from the config
(any torch.optim class by name, or a factory; optimizer.no_decay and optimizer.groups: param_groups.py; the
schedule: schedules.py), or given to the Trainer in code, as an object or a factory."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from dtrain import factory
from dtrain.config import Config, OptimizerConfig, TrainingConfig
from dtrain.config.torch_names import config_keys, optimizer_class
from dtrain.errors import ConfigError, DtrainError
from dtrain.train.param_groups import param_groups
from dtrain.train.schedules import Schedule, spec_of

_CPU = torch.device("cpu")

# What Trainer(optimizer=..., scheduler=...) take: the object, or a factory of it (given the parameter groups
# of optimizer.no_decay and optimizer.groups, resp. the optimizer) — a factory is needed under FSDP, which
# replaces the model's parameters when it shards them.
OptimizerArg = torch.optim.Optimizer | Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
SchedulerArg = LRScheduler | Callable[[torch.optim.Optimizer], LRScheduler]


def build(
    config: Config,
    module: nn.Module,
    given: tuple[OptimizerArg | None, SchedulerArg | None],
    device: torch.device,
    total_steps: int,
) -> tuple[torch.optim.Optimizer, LRScheduler | Schedule]:
    """The run's optimizer and schedule: those given in code (objects, or factories called here), else the config's."""
    optimizer_arg, scheduler_arg = given
    if isinstance(optimizer_arg, torch.optim.Optimizer):
        optimizer = _own_parameters(optimizer_arg, module)
    elif optimizer_arg is not None:
        # A factory's optimizer may decay by default (torch's AdamW does): the exempt groups are always made.
        optimizer = optimizer_arg(param_groups(module, config.optimizer.no_decay, config.optimizer.groups))
        _is(optimizer, torch.optim.Optimizer, "optimizer", "an optimizer")
    else:
        optimizer = build_optimizer(config.optimizer, module, device)
    if isinstance(scheduler_arg, LRScheduler):
        if scheduler_arg.optimizer is not optimizer:
            raise DtrainError(
                "Trainer(scheduler=...) schedules another optimizer than the run's; pass a factory taking the "
                "optimizer, e.g. scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, 100)"
            )
        return optimizer, scheduler_arg
    if scheduler_arg is not None:
        scheduler = scheduler_arg(optimizer)
        _is(scheduler, LRScheduler, "scheduler", "a torch.optim.lr_scheduler scheduler")
        return optimizer, scheduler
    lrs = [group["lr"] for group in optimizer.param_groups]
    return optimizer, Schedule(optimizer, spec_of(config.scheduler, config.optimizer.lr, total_steps, lrs))


def build_optimizer(config: OptimizerConfig, module: nn.Module, device: torch.device = _CPU) -> torch.optim.Optimizer:
    """optimizer.name's optimizer over the groups of optimizer.no_decay and optimizer.groups."""
    if ":" in config.name:  # package.module:Class
        make = factory.resolve("optimizer.name", config.name)
        groups = param_groups(module, config.no_decay, config.groups)
        offered = {"params": groups, "lr": config.lr, "weight_decay": config.weight_decay}
        optimizer = factory.call(make, offered, config.kwargs, "optimizer.kwargs")
        _is(optimizer, torch.optim.Optimizer, "optimizer", "an optimizer", key=f"optimizer.name = '{config.name}'")
        return optimizer
    cls = optimizer_class(config.name)
    own = config_keys(cls)
    kwargs: dict[str, Any] = {key: getattr(config, key) for key in own}
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    kwargs.update(implementation_options(cls, device))
    kwargs.update(config.kwargs)
    # Exempt groups only where something decays: with no weight decay anywhere the groups stay as they were.
    decays = "weight_decay" in own and (config.weight_decay > 0 or any(g.get("weight_decay") for g in config.groups))
    groups = param_groups(module, config.no_decay if decays else [], config.groups)
    try:
        return cls(groups, **kwargs)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"optimizer.name = '{config.name}' cannot be built with these settings: {exc}") from None


def implementation_options(cls: type, device: torch.device) -> dict[str, bool]:
    """AdamW on CUDA uses torch's fused kernel: one launch for all parameters, faster than the default
    multi-tensor path, and GradScaler hands it its inf check on the device, where the other paths
    read it on the host every step. SGD is never fused: torch's fused SGD fills its momentum buffers
    with uninitialised memory on a step GradScaler skips. Elsewhere torch's default (the CPU numbers
    stay those of a plain torch.optim loop, which the parity tests compare against)."""
    if cls is torch.optim.AdamW and device.type == "cuda" and "fused" in inspect.signature(cls).parameters:
        return {"fused": True}
    return {}


def planned_steps(training: TrainingConfig, steps_per_epoch: int) -> int:
    """The optimizer steps the run plans: `training.epochs`, or fewer where `training.max_steps` says so."""
    steps = training.epochs * steps_per_epoch
    return min(steps, training.max_steps) if training.max_steps else steps


def _own_parameters(optimizer: torch.optim.Optimizer, module: nn.Module) -> torch.optim.Optimizer:
    own = {id(p) for p in module.parameters()}
    if not all(id(p) in own for group in optimizer.param_groups for p in group["params"]):
        raise DtrainError(
            "Trainer(optimizer=...) holds parameters the model does not have (FSDP replaces them when it shards "
            "the model); pass a factory taking the parameter groups instead, e.g. "
            "optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4)"
        )
    return optimizer


def _is(value: Any, kind: type, arg: str, what: str, key: str = "") -> None:
    if not isinstance(value, kind):
        raise DtrainError(f"{key or f'Trainer({arg}=...)'}'s factory returned {type(value).__name__}, not {what}")
