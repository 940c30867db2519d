"""Tensor parallel (with sequence parallel): each layer's weights split over the `tp` dimension of the
mesh (dims.py) by a plan, a dict of module-name patterns → torch's parallel styles, as
`parallelize_module` takes it. The plan is, first found:

    yours       `Trainer(..., tp_plan=...)`, for any model
    the model's a `tp_plan()` method (the built-in GPT's: models/gpt/tp_plan.py); one taking `loss_parallel`
                is asked for logits split over the vocabulary when the loss is dtrain's cross-entropy
    Hugging Face the model's own (`base_model_tp_plan` of its config), applied by transformers' own
                helper (`apply_tensor_parallelism`)

The strategy layer applies it first, before activation checkpointing and compile per block, then FSDP
over the data dimensions (torchtitan's order). Parameters become DTensors on the tensor-parallel mesh
(on the 2-D mesh once FSDP shards them too); DCP checkpoints them as they are and reshards on resume.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from fnmatch import fnmatch
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dtrain.errors import ConfigError
from dtrain.parallel.base import Strategy
from dtrain.parallel.dims import ParallelDims
from dtrain.parallel.dtensors import clip_grad_norm, gathered_state_dict
from dtrain.parallel.model_hooks import offered

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

HOW = (
    "give a plan: dtrain.Trainer(..., tp_plan={'layers.*.up': ColwiseParallel(), ...}) with torch's "
    "parallel styles, or a tp_plan() method on the model returning one; or set parallel.tp_size=1"
)


def problem(
    module: nn.Module,
    tp: int,
    plan: Mapping[str, Any] | None = None,
    window: int | None = None,
    sizes: Collection[int] | None = None,
) -> str | None:
    """Why `module` cannot be split over `tp` processes (no plan; sizes its plan cannot split, windows of
    `window` tokens among them), or None. The sizes a refusal offers are of `sizes` (those the world
    takes), where given."""
    if tp == 1 or plan is not None:
        return None
    hooks = offered(module)
    if hooks.tp_plan is not None:
        check = hooks.tp_problem
        if check is None:
            return None
        return check(tp, window) if sizes is None else check(tp, window, sizes)
    hf = _hf_model(module)
    if hf is None:
        return f"{type(module).__name__} has no tensor-parallel plan (parallel.tp_size = {tp}); {HOW}"
    config = hf.config
    heads = {k: getattr(config, k, None) for k in ("num_attention_heads", "num_key_value_heads")}
    uneven = {k: v for k, v in heads.items() if isinstance(v, int) and v % tp}
    if uneven:
        counts = [v for v in heads.values() if isinstance(v, int)]
        fits = [d for d in range(1, min(counts) + 1) if all(c % d == 0 for c in counts)]
        fits = [d for d in fits if sizes is None or d in sizes]
        named = ", ".join(f"{k} = {v}" for k, v in uneven.items())
        return (
            f"parallel.tp_size = {tp} must divide the model's heads ({named}), each rank holding whole "
            f"heads; use parallel.tp_size in {fits}"
        )
    return None


def parallelize(
    module: nn.Module, mesh: DeviceMesh, plan: Mapping[str, Any] | None = None, loss_parallel: bool = False
) -> bool:
    """Split `module` over `mesh` (the tensor-parallel dimension) by `plan`, else its own; refused in one
    line when there is none. Parameters tied before (the GPT's embedding and head) are tied again after.
    With `loss_parallel` (the step's loss is dtrain's cross-entropy, which takes logits split over the
    vocabulary), a model whose own plan can leave them split (`tp_plan(loss_parallel=True)`) is asked
    to; returns whether it was."""
    found = problem(module, mesh.size(), plan)
    if found:
        raise ConfigError(found)
    tied, split_logits = _tied_names(module), False
    hooks = offered(module)
    hf = _hf_model(module) if plan is None and hooks.tp_plan is None else None
    if hf is not None:  # its plan names its own modules, by style names transformers knows
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism

        expanded = hf._expand_parallel_plan(dict(hf.tp_plan))  # type: ignore[operator, arg-type]
        apply_tensor_parallelism(hf, mesh, expanded)
    else:
        from torch.distributed.tensor.parallel import parallelize_module

        if plan is not None:
            chosen = dict(plan)
            if not chosen:  # every rank would compute every layer whole, and say nothing
                raise ConfigError(f"the tensor-parallel plan given for {type(module).__name__} is empty; {HOW}")
            unmatched = [pattern for pattern in chosen if not _matches_a_module(module, pattern)]
            if unmatched:  # torch would skip them with a warning per rank: every rank computing whole layers
                raise ConfigError(
                    f"the tensor-parallel plan's {', '.join(map(repr, unmatched))} names no module of "
                    f"{type(module).__name__}; name modules as model.named_modules() does "
                    f"(here: {', '.join(_some_module_names(module))})"
                )
        else:
            chosen, split_logits = hooks.plan(loss_parallel)
        parallelize_module(module, mesh, chosen)
    for names in tied:
        _tie(module, names)
    return split_logits


class TensorParallel(Strategy):
    """Tensor parallel over every process (`parallel.strategy = ddp` with no data-parallel copies):
    each rank holds its shards; the collectives run inside forward and backward, no gradient is averaged."""

    forward_is_collective = True
    shards_state = True
    comm_in_compute = True

    def __init__(self, module: nn.Module, dims: ParallelDims):
        if dims.dp != 1:  # check_sharding's promise: copies of a tensor-parallel model are FSDP's
            raise ValueError(f"tensor parallel alone runs with one data-parallel replica; got {dims}")
        super().__init__(module, dims)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm(self.module, max_norm)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        return gathered_state_dict(self.module, torch.distributed.get_rank() == 0)


def _hf_model(module: nn.Module) -> nn.Module | None:
    """The outermost Hugging Face model in `module` (itself, or one it wraps) with a tensor-parallel plan."""
    for sub in module.modules():
        if getattr(sub, "tp_plan", None) and callable(getattr(sub, "_expand_parallel_plan", None)):
            return sub
    return None


def _matches_a_module(module: nn.Module, pattern: str) -> bool:
    """Whether `pattern` names a module as parallelize_module reads it: dot-separated, each part a glob."""
    parts = pattern.split(".")
    return pattern == "" or any(
        len(names) == len(parts) and all(fnmatch(n, p) for n, p in zip(names, parts, strict=True))
        for names in (name.split(".") for name, _ in module.named_modules() if name)
    )


def _some_module_names(module: nn.Module, most: int = 8) -> list[str]:
    names = [name for name, _ in module.named_modules() if name]
    return names[:most] + (["…"] if len(names) > most else [])


def _tied_names(module: nn.Module) -> list[list[str]]:
    """The names of each parameter held under more than one name."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _tie(module: nn.Module, names: list[str]) -> None:
    """Make every name of `names` hold the first one's parameter again, where the plan split them alike."""
    first = module.get_parameter(names[0])
    for name in names[1:]:
        owner, _, attr = name.rpartition(".")
        holder = module.get_submodule(owner)
        other = getattr(holder, attr)
        if getattr(other, "placements", None) != getattr(first, "placements", None):
            raise ConfigError(
                f"the tensor-parallel plan splits the tied parameters {names[0]} and {name} differently "
                f"({getattr(first, 'placements', 'whole')} and {getattr(other, 'placements', 'whole')}); "
                f"split both alike, or untie them"
            )
        setattr(holder, attr, first)
