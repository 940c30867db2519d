"""The optimizer's parameter groups: which parameters decay (optimizer.no_decay) and which have settings of
their own (optimizer.groups), by the names of the user's own module — never a wrapper's: DDP's `module.`
prefix does not show, and FSDP2 keeps the names."""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

from torch import nn

from dtrain.errors import ConfigError

# optimizer.no_decay's words besides name patterns.
FEW_DIMENSIONS = "ndim<2"  # biases, norm weights: nanoGPT's configure_optimizers rule (`p.dim() < 2`)
EMBEDDINGS = "embeddings"  # nn.Embedding weights (tokens, positions): decayed by nanoGPT and HF Trainer alike


def param_groups(module: nn.Module, no_decay: list[str], groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Torch's parameter groups: one for the parameters no optimizer.groups entry names, then one per entry
    (the first whose pattern matches a name takes it), each split in two where `no_decay` exempts some of
    its parameters (`weight_decay` 0 there, whatever the group says). Empty groups are left out; every
    parameter is in exactly one group."""
    # A tied matrix once, under its first name; frozen parameters (LoRA's base) are no optimizer's business.
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    embedded = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    patterns = [[g["params"]] if isinstance(g["params"], str) else list(g["params"]) for g in groups]
    for i, group_patterns in enumerate(patterns):
        _refuse_unmatched(f"optimizer.groups[{i}].params", group_patterns, named)
    _refuse_unmatched("optimizer.no_decay", [p for p in no_decay if p not in (FEW_DIMENSIONS, EMBEDDINGS)], named)

    def exempt(name: str, param: nn.Parameter) -> bool:
        return any(
            (rule == FEW_DIMENSIONS and param.dim() < 2)
            or (rule == EMBEDDINGS and id(param) in embedded)
            or fnmatchcase(name, rule)
            for rule in no_decay
        )

    def group_of(name: str) -> int:
        return next((i for i, p in enumerate(patterns) if any(fnmatchcase(name, x) for x in p)), len(groups))

    built: list[dict[str, Any]] = []
    # The rest first: group 0 is optimizer.lr's, the learning rate the run logs.
    for index, settings in [(len(groups), {}), *enumerate(groups)]:
        own = {k: tuple(v) if isinstance(v, list) else v for k, v in settings.items() if k != "params"}
        for exempted in (False, True):
            params = [p for n, p in named if group_of(n) == index and exempt(n, p) == exempted]
            if params:
                built.append({"params": params, **own, **({"weight_decay": 0.0} if exempted else {})})
    return built


def decayed_names(module: nn.Module, optimizer_groups: list[dict[str, Any]]) -> set[str]:
    """The names of the parameters that `optimizer_groups` decay (weight_decay above 0)."""
    decayed = {id(p) for g in optimizer_groups if g.get("weight_decay", 0) > 0 for p in g["params"]}
    return {n for n, p in module.named_parameters() if id(p) in decayed}


def _refuse_unmatched(key: str, patterns: list[str], named: list[tuple[str, nn.Parameter]]) -> None:
    for pattern in patterns:
        if not any(fnmatchcase(name, pattern) for name, _ in named):
            some = ", ".join(name for name, _ in named[:4])
            raise ConfigError(
                f"{key}: '{pattern}' matches no parameter of the model (its names are like {some}, ...); "
                f"patterns are shell-style, e.g. 'lm_head.*' or '*.bias'"
            )
