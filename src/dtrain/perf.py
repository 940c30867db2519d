"""How fast, against what: model FLOPs per sample, the device's peak, MFU, and stragglers."""

from __future__ import annotations

import copy
import statistics
from typing import Any

import torch
from torch import nn

# Dense peak TFLOP/s of one device for 16-bit tensor-core math and for fp32 (TF32 where the device has
# it), from the vendors' data sheets. Matched against torch.cuda.get_device_name().
_PEAKS = [
    ("H200", 989.0, 494.0), ("H100", 989.0, 494.0), ("GH200", 989.0, 494.0),
    ("A100", 312.0, 156.0), ("A10G", 70.0, 35.0), ("A10", 125.0, 62.5), ("L40S", 362.0, 183.0),
    ("L4", 121.0, 60.0), ("V100", 125.0, 15.7), ("T4", 65.0, 8.1), ("RTX 4090", 165.0, 82.6),
    ("RTX 3090", 71.0, 35.6),
]


def peak_flops(device: torch.device, precision: str, override_tflops: float) -> float | None:
    """Peak FLOP/s of one device, or None when unknown (MFU is then not reported)."""
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, half, single in _PEAKS:
        if key in name:
            return (half if precision in ("bf16", "fp16") else single) * 1e12
    return None


def flops_per_sample(module: nn.Module, inputs: Any, batch: int) -> float | None:
    """Training FLOPs (forward + backward) per sample, counted once with torch's FLOP counter on a
    copy of the model on the meta device: no real compute, no RNG drawn, the model untouched."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        # Parameters and buffers become meta tensors in the copy: nothing the size of the model is copied.
        memo = {id(t): (nn.Parameter(torch.empty_like(t, device="meta"), t.requires_grad)
                        if isinstance(t, nn.Parameter) else torch.empty_like(t, device="meta"))
                for t in (*module.parameters(), *module.buffers())}
        meta = copy.deepcopy(module, memo)
        meta_inputs = _to_meta(inputs)
        with FlopCounterMode(display=False) as counter:
            out = meta(*meta_inputs) if isinstance(meta_inputs, tuple) else meta(meta_inputs)
            out = out[0] if isinstance(out, (tuple, list)) else out
            out.float().sum().backward()
        return counter.get_total_flops() / max(batch, 1)
    except Exception:  # noqa: BLE001 - an op without a meta kernel: no FLOPs, no MFU, training goes on
        return None


def _to_meta(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return torch.empty_like(obj, device="meta")
    if isinstance(obj, (tuple, list)):
        return tuple(_to_meta(o) for o in obj)
    return obj


def stragglers(busy_ms: list[float], margin: float) -> list[tuple[int, float]]:
    """(rank, share slower than the median) for every rank busier than median × (1 + margin).

    Busy time excludes waiting in the gradient all-reduce: in synchronous data parallelism every
    rank's wall-clock step is the same, and it is the slow one that the others wait for.
    """
    if len(busy_ms) < 2:
        return []
    median = statistics.median(busy_ms)
    if median <= 0:
        return []
    return [(rank, ms / median - 1) for rank, ms in enumerate(busy_ms) if ms > median * (1 + margin)]
