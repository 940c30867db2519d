"""Mixed precision with torch.amp: bf16 autocast on CUDA and CPU, fp16 autocast with GradScaler on CUDA."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch

from .errors import ConfigError


@dataclass
class Precision:
    name: str
    autocast: Callable[[], ContextManager]  # wraps forward + loss
    scaler: torch.amp.GradScaler  # disabled (a pass-through) unless fp16


def precision_for(name: str, device: torch.device) -> Precision:
    """The autocast context and grad scaler for `training.precision` on `device`, or a clear refusal."""
    if name == "fp32":
        return Precision(name, contextlib.nullcontext, torch.amp.GradScaler(device.type, enabled=False))
    if name == "fp16" and device.type != "cuda":
        raise ConfigError("training.precision = 'fp16' needs a CUDA GPU (fp16 autocast with "
                          "GradScaler); on this CPU use training.precision=bf16 or fp32")
    if name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"training.precision = 'bf16' is not supported by "
                          f"{torch.cuda.get_device_name(device)}; use training.precision=fp16 or fp32")
    dtype = torch.bfloat16 if name == "bf16" else torch.float16
    autocast = functools.partial(torch.autocast, device_type=device.type, dtype=dtype)
    # bf16 keeps fp32's exponent range, so only fp16 needs loss scaling.
    scaler = torch.amp.GradScaler(device.type, enabled=name == "fp16")
    return Precision(name, autocast, scaler)
