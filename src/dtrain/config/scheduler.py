"""[scheduler]: the learning-rate schedule."""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.config import torch_names
from dtrain.config.section import Section
from dtrain.config.settings import setting
from dtrain.errors import ConfigError


@dataclass(slots=True)
class SchedulerConfig(Section):
    name: str = setting(
        "constant",
        "The learning rate over the run: constant, constant_with_warmup, linear, cosine, cosine_with_restarts, "
        "polynomial, inverse_sqrt, warmup_stable_decay (transformers.get_scheduler's, computed by dtrain), nanogpt "
        "(nanoGPT's get_lr: cosine, warm-up (k + 1) / (warmup_steps + 1) at step k), or a torch.optim.lr_scheduler "
        "class by name (StepLR, OneCycleLR, ...; any case) with scheduler.kwargs.",
    )
    warmup_steps: int = setting(
        0,
        "Optimizer steps of linear warm-up from 0 to optimizer.lr, as transformers': the first step's "
        "learning rate is 0 (warmup_stable_decay: from the floor; nanogpt: optimizer.lr / (warmup_steps + 1)).",
        min=0,
    )
    decay_steps: int = setting(
        0,
        "The step at which the decay reaches its floor, after which the learning rate stays there "
        "(nanoGPT's lr_decay_iters; 0: the run's last step).",
        min=0,
    )
    min_lr: float = setting(
        0.0, "Where linear, cosine, polynomial and warmup_stable_decay end (polynomial's lr_end).", min=0
    )
    min_lr_ratio: float = setting(0.0, "The same floor as a share of optimizer.lr (set one of the two).", min=0, max=1)
    kwargs: dict = setting(
        {},
        "The schedule's own options: cosine {num_cycles}, cosine_with_restarts {num_cycles}, polynomial "
        "{power}, inverse_sqrt {timescale}, warmup_stable_decay {num_decay_steps, warmup_type, decay_type, "
        "num_cycles} (transformers' names and defaults); a torch class's arguments (e.g. StepLR "
        "{step_size = 100, gamma = 0.5}; OneCycleLR's total_steps and CosineAnnealingLR's T_max default to "
        "the run's steps).",
    )

    def check(self) -> None:
        cls = torch_names.scheduler_class(self.name)
        if cls is not None:
            shaped = [k for k in ("warmup_steps", "decay_steps", "min_lr", "min_lr_ratio") if getattr(self, k)]
            if shaped:
                raise ConfigError(
                    f"scheduler.{shaped[0]} shapes dtrain's own schedules, not {cls.__name__}; give its "
                    f"arguments as scheduler.kwargs, e.g. scheduler.kwargs={{gamma = 0.9}}"
                )
            torch_names.refuse_unknown(
                "scheduler.kwargs", self.kwargs, torch_names.keywords(cls, skip=("optimizer",)), cls.__name__
            )
            missing = [key for key in torch_names.required(cls) if key not in self.kwargs]
            if missing:
                raise ConfigError(
                    f"scheduler.name = {cls.__name__} needs {', '.join(missing)}: "
                    f"scheduler.kwargs = {{{', '.join(f'{key} = ...' for key in missing)}}}"
                )
            return
        options = torch_names.SCHEDULE_OPTIONS.get(self.name, {})
        torch_names.refuse_unknown("scheduler.kwargs", self.kwargs, list(options), f"scheduler.name = {self.name}")
        if self.min_lr and self.min_lr_ratio:
            raise ConfigError("scheduler.min_lr and scheduler.min_lr_ratio both set the floor; set one of them")
        ends = self.name not in ("constant", "constant_with_warmup", "inverse_sqrt")
        for key in ("decay_steps", "min_lr"):
            if getattr(self, key) and not ends:
                raise ConfigError(f"scheduler.{key} is set and {self.name} never decays to a floor; leave it out")
        if self.decay_steps and self.decay_steps <= self.warmup_steps:
            raise ConfigError(
                f"scheduler.decay_steps = {self.decay_steps} ends the decay before warm-up ends "
                f"(scheduler.warmup_steps = {self.warmup_steps}); make it larger"
            )
        if self.name == "warmup_stable_decay" and not isinstance(self.kwargs.get("num_decay_steps"), int):
            raise ConfigError(
                "scheduler.name = warmup_stable_decay needs the length of its decay: scheduler.kwargs = "
                "{num_decay_steps = N} (steps)"
            )
        for key in ("warmup_type", "decay_type"):
            if key in self.kwargs and self.kwargs[key] not in ("linear", "cosine", "1-sqrt"):
                raise ConfigError(f"scheduler.kwargs.{key} = {self.kwargs[key]!r}: use linear, cosine or 1-sqrt")
