"""[optimizer]: the optimizer, its keyword arguments and its parameter groups."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dtrain.config import torch_names
from dtrain.config.section import Section, is_factory_ref
from dtrain.config.settings import setting
from dtrain.errors import ConfigError


@dataclass(slots=True)
class OptimizerConfig(Section):
    name: str = setting(
        "sgd",
        "Any optimizer of torch.optim by its class name, any case (sgd, adamw, Adam, Adagrad, RMSprop, NAdam, "
        "RAdam, Adamax, Adadelta, ASGD, Rprop, Adafactor, Muon), or a factory 'package.module:Class' called "
        "with the parameter groups, lr and weight_decay (where it names them) and optimizer.kwargs.",
    )
    lr: float = setting(0.01, "Peak learning rate.", above=0)
    momentum: float = setting(0.9, "SGD momentum (another optimizer's through optimizer.kwargs).", min=0, max=1)
    nesterov: bool = setting(False, "Nesterov momentum for SGD.")
    weight_decay: float = setting(
        0.0, "Weight decay (decoupled for adamw), of every parameter but optimizer.no_decay's.", min=0
    )
    betas: list[float] = setting([0.9, 0.999], "betas of the Adam family (adamw, Adam, NAdam, RAdam, Adamax).")
    eps: float = setting(1e-8, "epsilon of the Adam family.", above=0)
    kwargs: dict = setting(
        {},
        "More keyword arguments of the optimizer, as its class names them, e.g. {amsgrad = true} or, for "
        "RMSprop, {alpha = 0.9, momentum = 0.5}; a key it does not take is refused.",
    )
    no_decay: list[str] = setting(
        ["ndim<2"],
        "Parameters trained with weight_decay 0: ndim<2 (every parameter of fewer than two dimensions: biases, "
        "norm weights; nanoGPT's and Hugging Face Trainer's rule, which decay embeddings), embeddings (the "
        "weights of nn.Embedding modules), or name patterns such as '*.bias'; [] decays every parameter.",
    )
    groups: list[dict] = setting(
        [],
        "Parameter groups with their own settings: tables of params (a name pattern, or a list of them, "
        "matched against the model's own parameter names; first group wins) and optimizer settings, e.g. "
        "[{params = 'lm_head.*', lr = 1e-4}]. Their lr follows the schedule like optimizer.lr.",
    )

    def check(self) -> None:
        if self.nesterov and self.momentum == 0:
            raise ConfigError(
                "optimizer.nesterov = true needs momentum: set optimizer.momentum above 0 (0.9 is usual), "
                "or optimizer.nesterov=false"
            )
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"optimizer.betas = {self.betas} must be two numbers in [0, 1), e.g. [0.9, 0.999]")
        if any(not item.strip() for item in self.no_decay):
            raise ConfigError('optimizer.no_decay holds an empty pattern; e.g. optimizer.no_decay=["ndim<2"]')
        for i, group in enumerate(self.groups):
            _check_group(f"optimizer.groups[{i}]", group)
        if is_factory_ref(self.name):
            return  # the factory's own arguments are checked when it is called
        plain = not self.kwargs and all(set(group) <= {"params", "lr", "weight_decay"} for group in self.groups)
        if plain and self.name.lower() in torch_names.FAMILIAR:  # known without importing torch
            class_name, own, takes = *torch_names.FAMILIAR[self.name.lower()], []
        else:
            cls = torch_names.optimizer_class(self.name)
            class_name, own = cls.__name__, tuple(torch_names.config_keys(cls))
            takes = torch_names.keywords(cls, skip=("params",))
        for key, default in (("momentum", 0.9), ("nesterov", False), ("betas", [0.9, 0.999]), ("eps", 1e-8)):
            if key not in own and getattr(self, key) != default:
                raise ConfigError(
                    f"optimizer.{key} is set and {class_name} does not use it; leave it out"
                    + (f", or give {class_name}'s own as optimizer.kwargs" if key in takes else "")
                )
        if "weight_decay" not in own and self.weight_decay:
            raise ConfigError(f"optimizer.weight_decay is set and {class_name} takes no weight decay; leave it out")
        own_here = [key for key in self.kwargs if key in own or key == "params"]
        if own_here:
            raise ConfigError(f"optimizer.kwargs has '{own_here[0]}': set optimizer.{own_here[0]} instead")
        if not plain:
            torch_names.refuse_unknown("optimizer.kwargs", self.kwargs, [k for k in takes if k not in own], class_name)
            for i, group in enumerate(self.groups):
                torch_names.refuse_unknown(f"optimizer.groups[{i}]", group, ["params", *takes], class_name)

    @property
    def key(self) -> str:
        """The optimizer as a checkpoint records it: a torch class by its lower-case name (sgd, adamw)."""
        return self.name if is_factory_ref(self.name) else self.name.lower()


def _check_group(key: str, group: dict) -> None:
    patterns = group.get("params")
    if isinstance(patterns, str):
        patterns = [patterns]
    if not (isinstance(patterns, list) and patterns and all(isinstance(p, str) and p.strip() for p in patterns)):
        raise ConfigError(
            f"{key} needs params, a name pattern or a list of them, e.g. {{params = 'lm_head.*', lr = 1e-4}}"
        )
    for name, value in group.items():
        if name in ("lr", "weight_decay", "eps", "momentum") and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0
        ):
            raise ConfigError(f"{key}.{name} must be a number >= 0; got {value!r}")
