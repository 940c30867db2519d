"""The first step under `training.compile`, in which torch.compile compiles: timed on its own console
line, left out of the step-time breakdown and of samples/s and tokens/s; a compiler failure is one line."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from dtrain.data.batch import num_samples
from dtrain.errors import DtrainError
from dtrain.observe.metrics import StepMetrics, step_tokens
from dtrain.observe.steptime import StepTimer


def compiling_step(
    train_step: Callable[[list[Any]], None],
    micro_batches: list[Any],
    mode: str,
    metrics: StepMetrics,
    timer: StepTimer,
    say: Callable[[str], None],
) -> None:
    """Run `train_step` on the first step's `micro_batches` with the clocks paused, then say how long
    compiling (`training.compile=mode`) took."""
    metrics.pause()
    timing, timer.enabled = timer.enabled, False
    began = time.perf_counter()
    try:
        train_step(micro_batches)
    except Exception as exc:
        if not type(exc).__module__.startswith(("torch._dynamo", "torch._inductor")):
            raise
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise DtrainError(
            f"training.compile={mode} failed while compiling the first "
            f"step ({type(exc).__name__}: {first}); set training.compile=none"
        ) from None
    if metrics.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    timer.enabled = timing
    metrics.resume()
    samples = sum(num_samples(batch) for batch in micro_batches)
    metrics.leave_out_of_rates(samples, step_tokens(micro_batches), seconds)
    say(f"compiled ({mode}) in the first step: {seconds:.1f} s, left out of throughput")
