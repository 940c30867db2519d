"""How fast, against what: model FLOPs per sample, the device's peak, MFU, and stragglers."""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from dtrain.data import Batches

# Dense (no sparsity) peak TFLOP/s of one device, from the vendors' data sheets: 16-bit tensor-core math
# (bf16/fp16 with fp32 accumulation), TF32 tensor-core math (None where the device has no TF32), and
# plain FP32. Keyed by the exact name torch.cuda.get_device_name() reports, one entry per variant: an
# H100 PCIe is not an H100 SXM, an L40 is not an L40S or an L4. A name not listed gets no MFU unless
# monitor.peak_tflops gives the peak.
PEAKS: dict[str, tuple[float, float | None, float]] = {
    "NVIDIA B200": (2250.0, 1100.0, 75.0),
    "NVIDIA H200": (989.4, 494.7, 66.9),
    "NVIDIA H200 NVL": (835.5, 417.5, 60.0),
    "NVIDIA GH200 480GB": (989.4, 494.7, 66.9),
    "NVIDIA H100 80GB HBM3": (989.4, 494.7, 66.9),  # SXM5
    "NVIDIA H100 PCIe": (756.5, 378.0, 51.2),
    "NVIDIA H100 NVL": (835.5, 417.5, 60.0),
    "NVIDIA A100-SXM4-80GB": (312.0, 156.0, 19.5),
    "NVIDIA A100-SXM4-40GB": (312.0, 156.0, 19.5),
    "NVIDIA A100 80GB PCIe": (312.0, 156.0, 19.5),
    "NVIDIA A100-PCIE-40GB": (312.0, 156.0, 19.5),
    "NVIDIA L40S": (362.1, 183.0, 91.6),
    "NVIDIA L40": (181.0, 90.5, 90.5),
    "NVIDIA L4": (121.0, 60.0, 30.3),
    "NVIDIA A10": (125.0, 62.5, 31.2),
    "NVIDIA A10G": (70.0, 35.0, 31.2),
    "NVIDIA GeForce RTX 4090": (165.2, 82.6, 82.6),
    "NVIDIA GeForce RTX 3090": (71.0, 35.6, 35.6),
    "Tesla V100-SXM2-16GB": (125.0, None, 15.7),
    "Tesla V100-SXM2-32GB": (125.0, None, 15.7),
    "Tesla V100-PCIE-16GB": (112.0, None, 14.0),
    "Tesla V100-PCIE-32GB": (112.0, None, 14.0),
    "Tesla T4": (65.0, None, 8.1),
}


def peak_tflops_of(device_name: str, precision: str, tf32: bool) -> float | None:
    """Peak TFLOP/s of the math `precision` runs on `device_name` (None when the name is not known).

    fp32 with TF32 allowed runs its matmuls on TF32 tensor cores where the device has them, and is
    measured against that peak; with TF32 off (or no TF32) against plain FP32.
    """
    peaks = PEAKS.get(device_name.strip())
    if peaks is None:
        return None
    half, tf32_peak, single = peaks
    if precision in ("bf16", "fp16"):
        return half
    return tf32_peak if tf32 and tf32_peak is not None else single


def peak_flops(device: torch.device, precision: str, override_tflops: float, tf32: bool = True) -> float | None:
    """Peak FLOP/s of one device, or None when unknown (MFU is then not reported)."""
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    tflops = peak_tflops_of(torch.cuda.get_device_name(device), precision, tf32)
    return None if tflops is None else tflops * 1e12


def training_flops_per_sample(module: nn.Module, batches: Batches, loss_of: Callable) -> float | None:
    """Training FLOPs per sample of the whole (unsharded) module: from the model's own count per token
    where it has one (the built-in GPT: 6N + attention, as nanoGPT and PaLM count), else counted once on
    a meta-device copy of the first micro-batch (flops_per_sample)."""
    from dtrain.data.batch import num_samples, num_tokens, split

    micro_batch = next(iter(batches.epoch(0)))[0]
    samples, target = num_samples(micro_batch), split(micro_batch)[1]
    per_token, tokens = getattr(module, "flops_per_token", None), num_tokens(target)
    if callable(per_token) and tokens:
        return per_token(target.shape[-1]) * tokens / samples
    return flops_per_sample(module, micro_batch, samples, loss_of)


def flops_per_sample(module: nn.Module, batch: Any, samples: int, loss_of: Callable) -> float | None:
    """Training FLOPs (forward, loss, backward) per sample, counted once with torch's FLOP counter on a
    copy of the model on the meta device: no real compute, no RNG drawn, the model untouched."""
    from torch.utils.flop_counter import FlopCounterMode

    from dtrain.data.batch import map_tensors

    try:
        # Parameters and buffers become meta tensors in the copy: nothing the size of the model is copied.
        memo = {
            id(t): (
                nn.Parameter(torch.empty_like(t, device="meta"), t.requires_grad)
                if isinstance(t, nn.Parameter)
                else torch.empty_like(t, device="meta")
            )
            for t in (*module.parameters(), *module.buffers())
        }
        meta = copy.deepcopy(module, memo)
        meta_batch = map_tensors(batch, lambda t: torch.empty_like(t, device="meta"))
        with FlopCounterMode(display=False) as counter:
            loss, _, _ = loss_of(meta, meta_batch)
            loss.backward()
        return counter.get_total_flops() / max(samples, 1)
    except Exception:
        return None


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
