"""How fast this machine multiplies matrices: `dtrain doctor`'s peak for MFU on a CPU, and the launcher's
quick look at bf16 on a CPU, where without bf16 units it runs many times slower than fp32 — a run asking
for bf16 there to go faster would go slower, and should hear so once, at the start."""

from __future__ import annotations

import time

import torch

# bf16 matmuls this many times slower than fp32 are worth a note (a CPU with bf16 units is about as fast
# or faster; one without is typically 10-40 times slower).
SLOW_BF16 = 4.0


def matmul_tflops(device: str, dtype_name: str, threads: int, size: int | None = None, seconds: float = 0.4) -> float:
    """Dense matmul TFLOP/s one process reaches on `device` with `threads` intra-op threads: the peak to
    measure MFU against where no data sheet gives one (CPUs)."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    size = size or (4096 if device.startswith("cuda") else 512)  # CPUs without bf16 units are slow at it
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        a @ b  # warm-up: kernel choice, thread pool
        sync()
        runs, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds or runs < 1:
            a @ b
            runs += 1
            if runs % 4 == 0:
                sync()
        sync()
        return 2 * size**3 * runs / (time.perf_counter() - start) / 1e12
    finally:
        torch.set_num_threads(before)


def slow_bf16_note(fp32_tflops: float, bf16_tflops: float) -> str | None:
    """The note for training.precision=bf16 on a CPU measured at these rates, or None where bf16 is not
    many times slower."""
    ratio = fp32_tflops / bf16_tflops if bf16_tflops > 0 else float("inf")
    if ratio < SLOW_BF16:
        return None
    return (
        f"training.precision = 'bf16' on this CPU: its bf16 matmuls ran {ratio:.0f} times slower than fp32 in a "
        f"quick test (dtrain doctor measures both); training.precision=fp32 trains faster here"
    )


def cpu_bf16_note(threads: int) -> str | None:
    """Measure both rates briefly (about 20 ms: small matrices, a few ms each) with the threads a worker
    gets, and judge them (slow_bf16_note)."""
    fp32, bf16 = (matmul_tflops("cpu", name, threads, size=128, seconds=0.003) for name in ("fp32", "bf16"))
    return slow_bf16_note(fp32, bf16)
