"""What each rank holds: bytes of parameters, gradients and optimizer state, and its peak memory.

Measured once, from the tensors themselves (a DTensor counts only its local shard), in the first step:
gradients after its backward, parameters and optimizer state (which AdamW creates in its first step)
after the update. The peak is read at the first log step: CUDA's allocator on GPUs, the process's
peak resident set on CPUs. The numbers ride on the log step's gather (metrics.py) to rank 0, which
writes them into that step's record and one console line: DDP against FSDP at a glance.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where it is used: `dtrain report` reads records without it
    import torch
    from torch import nn

# The record's per-rank lists, in the order they travel.
FIELDS = ("param_bytes", "grad_bytes", "optimizer_bytes", "peak_bytes")


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes these tensors occupy on this rank (a DTensor's local shard only); shared storage once."""
    from torch.distributed.tensor import DTensor

    seen: set[tuple[int, Any]] = set()
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        key = (local.untyped_storage().data_ptr(), local.storage_offset())
        if local.numel() and key not in seen:
            seen.add(key)
            total += local.numel() * local.element_size()
    return total


def gradient_bytes(module: nn.Module) -> int:
    return held_bytes(p.grad for p in module.parameters() if p.grad is not None)


def state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(parameter bytes, optimizer-state bytes) on this rank."""
    import torch

    state = (t for entry in optimizer.state.values() for t in entry.values() if isinstance(t, torch.Tensor))
    return held_bytes(module.parameters()), held_bytes(state)


def peak_bytes(device: torch.device) -> tuple[int, str]:
    """This process's peak memory so far, and what measured it."""
    if device.type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated(device), "CUDA allocator"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak * (1 if sys.platform == "darwin" else 1024), "process RSS"


def describe(record: dict, source: str | None = None) -> str:
    """The console line for a record holding the per-rank FIELDS."""

    def size(n: float) -> str:
        for unit in ("B", "KiB", "MiB", "GiB"):
            if n < 1024 or unit == "GiB":
                return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
            n /= 1024
        return ""

    most = {name: max(record[name]) for name in FIELDS}
    ranks = len(record["param_bytes"])
    layout = f"{record['layout']}; " if record.get("layout") else ""  # how the processes split the model
    which = f" ({layout}the most any of {ranks} holds)" if ranks > 1 else ""
    return (
        f"memory per rank{which}: parameters "
        f"{size(most['param_bytes'])}, gradients {size(most['grad_bytes'])}, optimizer state "
        f"{size(most['optimizer_bytes'])}; peak {size(most['peak_bytes'])}" + (f" ({source})" if source else "")
    )
