"""Tensor parallel (with sequence parallel): each layer's weights split over the `tp` dimension of the
mesh (dims.py) by a plan, a dict of module-name patterns → torch's parallel styles, as
`parallelize_module` takes it. The plan is, first found:

    yours       `Trainer(..., tp_plan=...)`, for any model
    the model's a `tp_plan()` method (the built-in GPT's: models/gpt_tp.py)
    Hugging Face the model's own (`base_model_tp_plan` of its config), applied by transformers: refused
                here in one line, as its helpers need a CUDA-style device and run on none of ours

The strategy layer applies it first, before activation checkpointing and compile per block, then FSDP
over the data dimensions (torchtitan's order). Parameters become DTensors on the tensor-parallel mesh
(on the 2-D mesh once FSDP shards them too); DCP checkpoints them as they are and reshards on resume.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dtrain.errors import ConfigError
from dtrain.parallel.base import Strategy
from dtrain.parallel.dims import ParallelDims
from dtrain.parallel.dtensors import clip_grad_norm, gathered_state_dict

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

HOW = (
    "give a plan: dtrain.Trainer(..., tp_plan={'layers.*.up': ColwiseParallel(), ...}) with torch's "
    "parallel styles, or a tp_plan() method on the model returning one; or set distributed.tp_size=1"
)


def problem(module: nn.Module, tp: int, plan: Mapping[str, Any] | None = None) -> str | None:
    """Why `module` cannot be split over `tp` processes (no plan; sizes the model's plan cannot split), or None."""
    if tp == 1:
        return None
    if plan is None and not callable(getattr(module, "tp_plan", None)):
        if _hf_plan(module):
            return (
                f"{type(module).__name__} has a tensor-parallel plan of its own (base_model_tp_plan), which "
                f"transformers applies only on its own devices; {HOW}"
            )
        return f"{type(module).__name__} has no tensor-parallel plan (distributed.tp_size = {tp}); {HOW}"
    check = getattr(module, "tp_problem", None)
    return check(tp) if plan is None and callable(check) else None


def parallelize(module: nn.Module, mesh: DeviceMesh, plan: Mapping[str, Any] | None = None) -> None:
    """Split `module` over `mesh` (the tensor-parallel dimension) by `plan`, else its own; refused in one
    line when there is none. Parameters tied before (the GPT's embedding and head) are tied again after."""
    found = problem(module, mesh.size(), plan)
    if found:
        raise ConfigError(found)
    from torch.distributed.tensor.parallel import parallelize_module

    chosen = dict(plan) if plan is not None else module.tp_plan()  # type: ignore[operator]
    tied = _tied_names(module)
    parallelize_module(module, mesh, chosen)
    for names in tied:
        _tie(module, names)


class TensorParallel(Strategy):
    """Tensor parallel over every process (`distributed.strategy = ddp` with no data-parallel copies):
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


def _hf_plan(module: nn.Module) -> bool:
    return any(
        getattr(m, "_tp_plan", None) or getattr(getattr(m, "config", None), "base_model_tp_plan", None)
        for m in module.modules()
    )


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
