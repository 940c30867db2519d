"""What the strategies whose parameters are DTensors (FSDP's shards, tensor parallel's) share: the
global gradient norm, and the whole weights gathered one tensor at a time.

No import of torch.distributed.tensor here (it costs a worker about 0.7 s at start-up): a process that
never imported it holds no DTensor, so `is_dtensor` asks sys.modules first.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, TypeGuard, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def is_dtensor(value: object) -> TypeGuard[DTensor]:
    """Whether `value` is a DTensor, without importing torch.distributed.tensor."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def clip_grad_norm(module: nn.Module, max_norm: float) -> torch.Tensor:
    """The global norm over every shard, clipped to `max_norm`; returned as a plain tensor. torch's own
    clip refuses DTensor and plain gradients mixed (parameters a plan left whole)."""
    params = [p for p in module.parameters() if p.grad is not None]
    total = grad_norm([cast(torch.Tensor, p.grad) for p in params])
    for group in (
        [p for p in params if is_dtensor(p.grad)],
        [p for p in params if not is_dtensor(p.grad)],
    ):
        if group:
            nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor` (its shard where it is a DTensor; itself otherwise)."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def placed_as_parameter(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`grad` laid out as `param` is (an embedding's backward leaves its gradient replicated where its
    weight is sharded): from a replicated gradient each rank keeps its shard, without a collective."""
    if is_dtensor(grad) and is_dtensor(param) and grad.placements != param.placements:
        return grad.redistribute(param.device_mesh, param.placements)
    return grad


def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of `grads` over every shard, as a plain tensor: DTensor gradients' norms reduced over
    their meshes (a replicated one counted once), plain ones as they are."""
    norms = []
    for group in ([g for g in grads if is_dtensor(g)], [g for g in grads if not is_dtensor(g)]):
        if group:
            norm = nn.utils.get_total_norm(group)
            norms.append(norm.full_tensor() if is_dtensor(norm) else norm)
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


def whole(value: torch.Tensor) -> torch.Tensor:
    """`value` whole: a DTensor gathered from its shards (a collective of its mesh), else itself. FSDP × TP
    shards can only be gathered one dimension after the other, which torch warns about on every rank;
    for the one gather of final weights that is the price, not a fault, so the warning is kept back."""
    if not is_dtensor(value):
        return value
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        return value.full_tensor()
    finally:
        log.setLevel(level)


def gathered_state_dict(module: nn.Module, main: bool) -> dict[str, torch.Tensor] | None:
    """The whole model's weights, gathered one tensor at a time (a collective per DTensor): a rank never
    holds more than one full parameter beyond its shards; `main` keeps each on the CPU, the others
    nothing (None). Tied parameters stay one tensor."""
    gathered: dict[tuple, torch.Tensor] = {}
    full: dict[str, torch.Tensor] = {}
    for name, value in module.state_dict().items():
        local = value.to_local() if is_dtensor(value) else value
        same = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(value.shape))
        if same not in gathered:  # state_dict() detaches: a tied parameter shows as two objects
            tensor = whole(value)
            gathered[same] = tensor.detach().cpu() if main else tensor.new_empty(0)
        full[name] = gathered[same]
    return full if main else None
