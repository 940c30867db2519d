"""`profile.steps = "20-25"`: trace those optimizer steps with torch.profiler, one file per rank."""

from __future__ import annotations

from pathlib import Path

import torch


class StepProfiler:
    def __init__(self, steps: tuple[int, int] | None, run_dir: Path, rank: int, cuda: bool):
        self.steps = steps
        self.out = Path(run_dir) / "profile"
        self.rank = rank
        self.cuda = cuda
        self._profiler: torch.profiler.profile | None = None
        self._step_range: torch.profiler.record_function | None = (
            None  # the open "dtrain step N" range: each step is labelled in the trace
        )

    def before_step(self, step: int) -> None:
        """Start before the first step of the range, stop (and write) before the one after it."""
        if self.steps is None:
            return
        self._end_step_range()
        first, last = self.steps
        if self._profiler is None and first <= step <= last:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self._profiler.start()
        elif self._profiler is not None and step > last:
            self.close()
            return
        if self._profiler is not None:
            self._step_range = torch.profiler.record_function(f"dtrain step {step}")
            self._step_range.__enter__()

    def _end_step_range(self) -> None:
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None

    def close(self) -> None:
        if self._profiler is None:
            return
        self._end_step_range()
        self._profiler.stop()
        self.out.mkdir(parents=True, exist_ok=True)
        # A Chrome trace: opens in Perfetto, and in TensorBoard's profiler (tensorboard --logdir profile).
        self._profiler.export_chrome_trace(str(self.out / f"rank-{self.rank}.pt.trace.json"))
        self._profiler = None
        self.steps = None
