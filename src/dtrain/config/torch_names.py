"""Which torch optimizers and learning-rate schedules a config can name, and which keyword arguments each
takes: checked when the config is read (one line naming what works), used again where they are built.
torch is imported on the first check only: reading a config that names nothing from it stays quick."""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from dtrain.errors import ConfigError

# torch.optim classes a training step cannot drive: the step calls optimizer.step() once, with dense gradients.
UNSTEPPABLE = {"LBFGS": "needs a closure that re-evaluates the loss", "SparseAdam": "takes sparse gradients only"}

# The keys of [optimizer] that dtrain passes to an optimizer itself (the others go through optimizer.kwargs):
# known for the two usual ones without importing torch, found in the signature for the others (config_keys).
FAMILIAR: dict[str, tuple[str, tuple[str, ...]]] = {
    "sgd": ("SGD", ("lr", "weight_decay", "momentum", "nesterov")),
    "adamw": ("AdamW", ("lr", "weight_decay", "betas", "eps")),
}

# dtrain's own schedules: transformers.get_scheduler's family, as pure functions of the step (train.schedules).
OWN_SCHEDULES = (
    "constant",
    "constant_with_warmup",
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "inverse_sqrt",
    "warmup_stable_decay",
    "nanogpt",  # nanoGPT's get_lr: cosine to min_lr, its own warm-up
)
# Each one's options (scheduler.kwargs), with transformers' names and defaults.
SCHEDULE_OPTIONS: dict[str, dict[str, Any]] = {
    "cosine": {"num_cycles": 0.5},
    "cosine_with_restarts": {"num_cycles": 1},
    "polynomial": {"power": 1.0},
    "inverse_sqrt": {"timescale": None},
    "warmup_stable_decay": {
        "num_decay_steps": None,
        "warmup_type": "linear",
        "decay_type": "cosine",
        "num_cycles": 0.5,
    },
}
# torch.optim.lr_scheduler classes a name cannot build: they take callables or other schedulers, or a metric.
_UNNAMEABLE = ("LRScheduler", "LambdaLR", "MultiplicativeLR", "SequentialLR", "ChainedScheduler", "ReduceLROnPlateau")


def optimizer_classes() -> dict[str, type]:
    """Every optimizer of torch.optim a run can use, by its lower-case class name."""
    import torch

    return {
        name.lower(): cls
        for name, cls in vars(torch.optim).items()
        if isinstance(cls, type)
        and issubclass(cls, torch.optim.Optimizer)
        and cls is not torch.optim.Optimizer
        and name not in UNSTEPPABLE
        and not name.startswith("_")
    }


def optimizer_class(name: str) -> type:
    """The torch.optim class `optimizer.name` names (any case), or a one-line refusal listing those that work."""
    found = optimizer_classes().get(name.lower())
    if found is not None:
        return found
    usable = sorted(cls.__name__ for cls in optimizer_classes().values())
    why = f" ({name} {UNSTEPPABLE[name]})" if name in UNSTEPPABLE else ""
    close = difflib.get_close_matches(name.lower(), list(optimizer_classes()), n=1)
    hint = f"; did you mean '{optimizer_classes()[close[0]].__name__}'?" if close and not why else ""
    raise ConfigError(
        f"optimizer.name = '{name}' is not an optimizer dtrain can step{why}; use one of torch.optim's "
        f"{', '.join(usable)} (any case), or a factory 'package.module:Class'{hint}"
    )


def config_keys(cls: type) -> tuple[str, ...]:
    """The keys of [optimizer] passed to `cls`: lr, weight_decay where it takes it, SGD's momentum and nesterov,
    the Adam family's betas and eps (every class taking betas and eps: their defaults are torch's own)."""
    takes = keywords(cls)
    keys = ["lr", *(["weight_decay"] if "weight_decay" in takes else [])]
    if cls.__name__ == "SGD":
        keys += ["momentum", "nesterov"]
    if "betas" in takes and "eps" in takes:
        keys += ["betas", "eps"]
    return tuple(keys)


def scheduler_classes() -> dict[str, type]:
    """The torch.optim.lr_scheduler classes a name can build, by lower-case class name."""
    from torch.optim import lr_scheduler

    return {
        name.lower(): cls
        for name, cls in vars(lr_scheduler).items()
        if isinstance(cls, type)
        and issubclass(cls, lr_scheduler.LRScheduler)
        and name not in _UNNAMEABLE
        and not name.startswith("_")
    }


def scheduler_class(name: str) -> type | None:
    """None for one of dtrain's own schedules; else the torch class, or a one-line refusal listing both kinds."""
    if name in OWN_SCHEDULES:
        return None
    found = scheduler_classes().get(name.lower())
    if found is not None:
        return found
    torch_names = sorted(cls.__name__ for cls in scheduler_classes().values())
    close = difflib.get_close_matches(name.lower(), [*OWN_SCHEDULES, *scheduler_classes()], n=1)
    hint = ""
    if close:
        hint = f"; did you mean '{close[0] if close[0] in OWN_SCHEDULES else scheduler_classes()[close[0]].__name__}'?"
    raise ConfigError(
        f"scheduler.name = '{name}' is no schedule; use one of {', '.join(OWN_SCHEDULES)} or "
        f"torch.optim.lr_scheduler's {', '.join(torch_names)}{hint}"
    )


def keywords(cls: type, skip: tuple[str, ...] = ()) -> list[str]:
    """The keyword arguments `cls(...)` takes, less `skip` (what dtrain passes itself)."""
    params = inspect.signature(cls).parameters.values()
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in skip]


# Arguments of torch's schedulers that dtrain fills in unless given: the run's steps, the peak learning rate.
FILLED = {"OneCycleLR": ("max_lr", "total_steps"), "CosineAnnealingLR": ("T_max",)}


def required(cls: type) -> list[str]:
    """The arguments `cls(optimizer, ...)` cannot do without that dtrain does not fill in."""
    params = list(inspect.signature(cls).parameters.values())[1:]
    filled = FILLED.get(cls.__name__, ())
    return [p.name for p in params if p.default is p.empty and p.kind != p.VAR_KEYWORD and p.name not in filled]


def refuse_unknown(key: str, given: dict[str, Any] | list[str], takes: list[str], what: str) -> None:
    """One line naming the first of `given` that `what` does not take, and what it takes."""
    unknown = [k for k in given if k not in takes]
    if unknown:
        raise ConfigError(
            f"{key} has '{unknown[0]}', which {what} does not take; it takes {', '.join(takes) or 'nothing more'}"
        )
