"""The learning-rate schedule: transformers.get_scheduler's family computed here as pure functions of the step
(`Shape`, so transformers is no dependency), or a torch.optim.lr_scheduler class by name; both inside
`Schedule`, whose checkpointed state says what built it, so that a resumed run follows its own config.

Warm-up follows transformers: the learning rate of optimizer step k (from 0) is peak × k / warmup_steps, so
the first step's is 0 (dtrain before 0.3 was one step ahead: (k + 1) / warmup_steps). nanoGPT's is
(k + 1) / (warmup + 1): `scheduler.name = "nanogpt"` is its get_lr (that warm-up, then transformers'
cosine with a floor, which is nanoGPT's decay to min_lr at lr_decay_iters).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from dtrain.config import SchedulerConfig
from dtrain.config.torch_names import SCHEDULE_OPTIONS, scheduler_class
from dtrain.errors import ConfigError


class Shape:
    """The multiplier of each group's peak learning rate at optimizer step `step`, as transformers computes
    it, with two additions: a floor (`floor`, a share of the peak) where the decay ends, and an end of the
    decay (`horizon`, scheduler.decay_steps) before the run's, after which the floor holds.

    A plain object of JSON values rather than a closure: LambdaLR checkpoints its __dict__.
    """

    def __init__(self, name: str, warmup: int, horizon: int, floor: float, options: dict[str, Any]):
        self.name, self.warmup, self.horizon, self.floor = name, warmup, max(horizon, 1), floor
        self.options = {**SCHEDULE_OPTIONS.get(name, {}), **options}
        if name == "inverse_sqrt" and self.options["timescale"] is None:
            self.options["timescale"] = warmup or 10_000  # transformers' default

    def __call__(self, step: int) -> float:
        name, warmup, end, floor, o = self.name, self.warmup, self.horizon, self.floor, self.options
        if name == "warmup_stable_decay":
            return self._warmup_stable_decay(step)
        if step < warmup:  # nanoGPT's get_lr(it): learning_rate * (it + 1) / (warmup_iters + 1)
            return (step + 1) / (warmup + 1) if name == "nanogpt" else step / max(1, warmup)
        if name in ("constant", "constant_with_warmup"):
            return 1.0
        if name == "inverse_sqrt":
            return 1.0 / math.sqrt((step + o["timescale"] - warmup) / o["timescale"])
        if step > end:  # past scheduler.decay_steps: the floor
            return floor
        progress = (step - warmup) / max(1, end - warmup)
        if name == "linear":
            factor = max(0.0, (end - step) / max(1, end - warmup))
        elif name == "cosine":
            factor = max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(o["num_cycles"]) * 2.0 * progress)))
        elif name == "nanogpt":  # its coeff: 0.5 * (1 + cos(pi * decay_ratio))
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        elif name == "cosine_with_restarts":
            factor = 0.0 if progress >= 1.0 else 0.5 * (1.0 + math.cos(math.pi * ((o["num_cycles"] * progress) % 1.0)))
        else:  # polynomial: transformers' lr_end is the floor
            factor = (1 - progress) ** o["power"]
        return floor + (1 - floor) * factor

    def _warmup_stable_decay(self, step: int) -> float:
        o, floor, warmup = self.options, self.floor, self.warmup
        decay = o["num_decay_steps"]
        stable = self.horizon - warmup - decay
        if step < warmup:  # from the floor up, as transformers' get_wsd_schedule
            progress = step / max(1, warmup)
            factor = _curve(o["warmup_type"], progress, rising=True, cycles=0.5)
            return max(0.0, factor * (1.0 - floor) + floor)
        if step < warmup + stable:
            return 1.0
        if step < warmup + stable + decay:
            progress = (step - warmup - stable) / max(1, decay)
            factor = _curve(o["decay_type"], progress, rising=False, cycles=o["num_cycles"])
            return max(0.0, factor * (1.0 - floor) + floor)
        return floor


def _curve(kind: str, progress: float, rising: bool, cycles: float) -> float:
    if kind == "linear":
        return progress if rising else 1.0 - progress
    if kind == "cosine":
        return (
            0.5 * (1.0 - math.cos(math.pi * progress))
            if rising
            else 0.5 * (1.0 + math.cos(math.pi * cycles * 2 * progress))
        )
    return 1.0 - math.sqrt(1.0 - progress) if rising else 1.0 - math.sqrt(progress)  # 1-sqrt


def spec_of(config: SchedulerConfig, peak: float, total_steps: int, lrs: list[float]) -> dict[str, Any]:
    """What builds the schedule, as JSON: kept in its checkpointed state, compared on resume."""
    floor = config.min_lr / peak if config.min_lr else config.min_lr_ratio
    if floor > 1:
        raise ConfigError(
            f"scheduler.min_lr = {config.min_lr:g} is above optimizer.lr = {peak:g}; the floor must be below the peak"
        )
    horizon = config.decay_steps or total_steps
    if config.name == "warmup_stable_decay" and config.warmup_steps + config.kwargs["num_decay_steps"] > horizon:
        raise ConfigError(
            f"scheduler.warmup_steps + scheduler.kwargs.num_decay_steps = "
            f"{config.warmup_steps + config.kwargs['num_decay_steps']} is more than the {horizon} steps the decay "
            f"ends by; shorten them"
        )
    return {
        "name": config.name,
        "steps": total_steps,
        "warmup_steps": config.warmup_steps,
        "decay_steps": config.decay_steps,
        "floor": floor,
        "kwargs": dict(config.kwargs),
        "lrs": list(lrs),
    }


# A spec's keys as the console names them when a resumed run's config changed them.
_LABELS = {
    "steps": "steps",
    "name": "scheduler.name",
    "warmup_steps": "scheduler.warmup_steps",
    "decay_steps": "scheduler.decay_steps",
    "floor": "scheduler.min_lr_ratio",
    "kwargs": "scheduler.kwargs",
}


class Schedule:
    """The run's schedule built from its config: a LambdaLR of `Shape` or a torch scheduler, stepped after
    every optimizer step. Its state is the scheduler's plus `spec`: loaded by a run whose spec differs (a
    longer run, another schedule or peak), it is rebuilt for this run's spec at the restored step instead
    — the config governs on resume — and `replanned` says what changed."""

    def __init__(self, optimizer: torch.optim.Optimizer, spec: dict[str, Any]):
        self.optimizer, self.spec = optimizer, spec
        self.replanned: str | None = None
        self.inner = self._build()

    def _build(self) -> LRScheduler:
        spec, optimizer = self.spec, self.optimizer
        cls = scheduler_class(spec["name"])
        if cls is None:
            shape = Shape(
                spec["name"], spec["warmup_steps"], spec["decay_steps"] or spec["steps"], spec["floor"], spec["kwargs"]
            )
            return LambdaLR(optimizer, [shape] * len(optimizer.param_groups))
        kwargs = dict(spec["kwargs"])
        if cls.__name__ == "OneCycleLR":
            kwargs.setdefault("max_lr", list(spec["lrs"]))
            if "epochs" not in kwargs:
                kwargs.setdefault("total_steps", spec["steps"])
        if cls.__name__ == "CosineAnnealingLR":
            kwargs.setdefault("T_max", spec["steps"])
        try:
            return cls(optimizer, **kwargs)
        except (TypeError, ValueError, KeyError) as exc:
            raise ConfigError(
                f"scheduler.name = '{spec['name']}' with scheduler.kwargs = {spec['kwargs']}: {exc}"
            ) from None

    @property
    def last_epoch(self) -> int:
        """The optimizer steps the schedule has taken (as torch's schedulers count them)."""
        return self.inner.last_epoch

    @property
    def drives(self) -> tuple[str, ...]:
        """Optimizer settings this schedule sets every step besides the learning rate (cycled momentum)."""
        return ("momentum", "betas") if getattr(self.inner, "cycle_momentum", False) else ()

    def step(self) -> None:
        self.inner.step()

    def get_last_lr(self) -> list[Any]:
        return self.inner.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return {"spec": self.spec, **self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        saved = state.pop("spec", None)
        if saved == self.spec:
            self.inner.load_state_dict(state)
            self.replanned = None
            return
        self.replanned = _changes(saved, self.spec)
        self.rebuild(int(state["last_epoch"]))

    def rebuild(self, step: int) -> None:
        """This spec's schedule at `step`: every group back at its peak, a new scheduler, advanced to `step`."""
        if not 0 <= step <= self.spec["steps"]:  # a checkpoint's number, judged before a replay counts to it
            raise ValueError(f"its schedule is at step {step}, outside this run's {self.spec['steps']} steps")
        for group, lr in zip(self.optimizer.param_groups, self.spec["lrs"]):
            group["lr"] = group["initial_lr"] = lr
        self.inner = self._build()
        with warnings.catch_warnings():  # torch warns of a scheduler stepped before its optimizer
            warnings.simplefilter("ignore")
            if isinstance(self.inner, LambdaLR):  # a pure function of the step: straight there
                self.inner.last_epoch = step - 1
                self.inner.step()
            else:  # torch's may depend on every earlier step: replayed
                for _ in range(step):
                    self.inner.step()

    def rewind(self, steps: int) -> None:
        """Take back the last `steps` steps (that GradScaler skipped)."""
        self.rebuild(self.inner.last_epoch - steps)


def _changes(saved: dict[str, Any] | None, wanted: dict[str, Any]) -> str:
    if saved is None:  # written before schedules kept their spec
        return f"scheduler.name (an earlier dtrain's schedule, warm-up one step ahead) → {wanted['name']}"
    said = [
        f"{label} {_show(saved.get(key))} → {_show(wanted[key])}"
        for key, label in _LABELS.items()
        if saved.get(key) != wanted[key]
    ]
    lrs_before, lrs_now = saved.get("lrs") or [None], wanted["lrs"]
    if lrs_before[0] != lrs_now[0]:
        said.append(f"optimizer.lr {_show(lrs_before[0])} → {_show(lrs_now[0])}")
    elif lrs_before != lrs_now:
        said.append("optimizer.groups' lr")
    return ", ".join(said)


def _show(value: Any) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)
