"""Mixed precision with torch.amp: bf16 autocast on CUDA and CPU, fp16 autocast with GradScaler on CUDA,
and fp32 that uses TF32 tensor cores on GPUs that have them (unless `training.tf32 = false`)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dtrain.errors import ConfigError


@dataclass
class Precision:
    name: str
    autocast: Callable[[], contextlib.AbstractContextManager]  # wraps forward + loss
    scaler: torch.amp.GradScaler  # disabled (a pass-through) unless fp16

    def found_inf(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """After `scaler.unscale_(optimizer)`: a device tensor, 1 when the gradients held inf/NaN and
        GradScaler will skip this step, else 0 (None without a scaler). Read without a host sync.

        GradScaler keeps this per optimizer and per device and offers no public reader; torch's own
        sharded scaler reads it the same way.
        """
        if not self.scaler.is_enabled():
            return None
        per_device = self.scaler._found_inf_per_device(optimizer)
        return sum(per_device.values()) if per_device else None


def precision_problem(
    name: str, device_type: str, gpu_name: str = "", capability: tuple[int, int] = (0, 0), rocm: bool = False
) -> str | None:
    """Why `training.precision = name` cannot run on this device, as a one-line answer (None: it can).

    bf16 needs native support (compute capability 8.0, Ampere, or newer; ROCm GPUs have it): V100 and
    T4 only emulate it, slower than fp32, which torch.cuda.is_bf16_supported() reports as supported.
    """
    if name == "fp16" and device_type != "cuda":
        return (
            "training.precision = 'fp16' needs a CUDA GPU (fp16 autocast with GradScaler); on this "
            "CPU use training.precision=bf16 or fp32"
        )
    if name == "bf16" and device_type == "cuda" and not rocm and capability[0] < 8:
        return (
            f"training.precision = 'bf16' is only emulated on {gpu_name} (compute capability "
            f"{capability[0]}.{capability[1]}; native bf16 needs 8.0 or newer); use "
            f"training.precision=fp16 or fp32"
        )
    return None


def precision_for(name: str, device: torch.device, tf32: bool = True) -> Precision:
    """The autocast context and grad scaler for `training.precision` on `device`, or a clear refusal.

    On a GPU this also sets how fp32 matmuls and convolutions run: TF32 tensor cores when `tf32`
    (torch's default for matmuls is true FP32, several times slower on Ampere and newer), full FP32
    otherwise.
    """
    if device.type == "cuda":
        problem = precision_problem(
            name,
            "cuda",
            torch.cuda.get_device_name(device),
            torch.cuda.get_device_capability(device),
            rocm=torch.version.hip is not None,
        )
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        torch.backends.cudnn.allow_tf32 = tf32  # convolutions: torch's default is TF32 already
    else:
        problem = precision_problem(name, device.type)
    if problem:
        raise ConfigError(problem)
    if name == "fp32":
        return Precision(name, contextlib.nullcontext, torch.amp.GradScaler(device.type, enabled=False))
    dtype = torch.bfloat16 if name == "bf16" else torch.float16
    autocast = functools.partial(torch.autocast, device_type=device.type, dtype=dtype)
    # bf16 keeps fp32's exponent range, so only fp16 needs loss scaling.
    scaler = torch.amp.GradScaler(device.type, enabled=name == "fp16")
    return Precision(name, autocast, scaler)
