"""Where a step's time goes: data wait, forward+backward, blocked on gradient communication, optimizer.

Every step is cut at four marks — before fetching its batches, when they are ready, after the last
backward, after the scheduler step — and the gradient-communication hook reports what it blocked.
On the CPU a mark is `time.perf_counter()`; on a GPU it is a CUDA event on the compute stream, read
only when the window is summed at a log step (the trainer syncs there anyway). Nothing here waits
for the device.

Communication time is what the training thread could not spend computing: the full duration of a
synchronous hook (dtrain's shared-memory average on CPU), or, for gloo's asynchronous all-reduce
between machines, the stretch from the last bucket's launch to the end of backward, when DDP waits
for the buckets still in flight. Where dtrain leaves DDP's comm-hook slot alone (GPUs, a compression
hook the user chose) a `comm_source` gives it instead: DDP's own measurement of its latest sampled
step, taken out of the forward+backward time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

PHASES = ("data", "compute", "comm", "optimizer")


class Progress:
    """What this rank is doing right now, for the hang watchdog: updated at every mark (a few
    attribute writes), read by the watchdog thread."""

    __slots__ = ("beat", "phase", "step")

    def __init__(self):
        self.step = 0
        self.phase = "starting"
        self.beat = time.monotonic()

    def at(self, phase: str) -> None:
        self.phase = phase
        self.beat = time.monotonic()


@dataclass
class _Window:
    steps: int = 0
    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    pending: list = field(default_factory=list)  # CUDA: (start, ready, backward, done, launch, sync)


class StepTimer:
    def __init__(self, device: torch.device, enabled: bool = True):
        self.progress = Progress()
        self.enabled = enabled
        self.cuda = device.type == "cuda"
        self._window = _Window()
        self._marks: list = []
        self._last_launch = None
        self._sync_s = 0.0
        self.comm_source: Callable[[], float | None] | None = None  # seconds per step, when no hook times it
        # FSDP's gathers and reduce-scatters run inside forward and backward, overlapped with them:
        # nothing here can tell them from compute, so the breakdown leaves comm out rather than show 0.
        self.comm_inside_compute = False
        self.bubble: float | None = None  # a pipeline's idle share of its latest step, in theory

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    # --- marks, in step order ---------------------------------------------------------------------

    def start(self) -> None:
        self.progress.at("waiting for data")
        if self.enabled:
            self._marks = [self._mark()]
            self._last_launch = None
            self._sync_s = 0.0

    def data_ready(self) -> None:
        self.progress.at("forward/backward")
        if self.enabled:
            self._marks.append(self._mark())

    def backward_done(self) -> None:
        self.progress.at("optimizer step")
        if self.enabled:
            self._marks.append(self._mark())

    def step_done(self) -> None:
        self.progress.step += 1
        self.progress.at("between steps")
        if not self.enabled:
            return
        self._marks.append(self._mark())
        start, ready, backward, done = self._marks
        if self.cuda:
            self._window.pending.append((start, ready, backward, done, self._last_launch, self._sync_s))
        else:
            self._add(ready - start, backward - ready, self._comm_seconds(backward, self._last_launch), done - backward)
        self._window.steps += 1

    # --- from the strategy's communication (parallel.observer.CommObserver) --------------------------

    def comm_launched(self) -> None:
        """A bucket was handed to an asynchronous all-reduce."""
        self.progress.at("gradient all-reduce")
        if self.enabled:
            self._last_launch = self._mark()

    def comm_blocked(self, seconds: float) -> None:
        """A synchronous hook held the training thread for `seconds`."""
        self.progress.at("forward/backward")
        if self.enabled:
            self._sync_s += seconds

    def awaiting_gradients(self) -> None:
        """Backward is over and the gradient all-reduce is what this rank waits for."""
        self.progress.at("gradient all-reduce")

    def pipeline_bubble(self, fraction: float) -> None:
        """The pipeline schedule's idle share of this step: (p−1)/(m+p−1), interleaved (p−1)/(v·m+p−1)."""
        self.bubble = fraction

    def sample_comm_from(self, source: Callable[[], float | None]) -> None:
        """Take the communication time from `source` (seconds per step) where no hook reports it."""
        self.comm_source = source

    # --- the window between log steps -----------------------------------------------------------

    def take(self) -> dict[str, float]:
        """Mean milliseconds per step for each phase since the last call (device work complete)."""
        window, self._window = self._window, _Window()
        if window.pending:
            window.pending[-1][3].synchronize()
        for start, ready, backward, done, launch, sync in window.pending:
            seconds = lambda a, b: a.elapsed_time(b) / 1000  # noqa: E731 - CUDA events, in ms
            comm = sync + (seconds(launch, backward) if launch is not None else 0.0)
            window.totals["data"] += seconds(start, ready)
            window.totals["comm"] += comm
            window.totals["compute"] += max(0.0, seconds(ready, backward) - comm)
            window.totals["optimizer"] += seconds(backward, done)
        steps = max(window.steps, 1)
        per_step = self.comm_source() if self.comm_source is not None and window.steps else None
        if per_step is not None:  # measured outside the step: move it from compute to comm
            comm = min(per_step * window.steps, window.totals["compute"])
            window.totals["comm"] += comm
            window.totals["compute"] -= comm
        return {phase: 1000 * total / steps for phase, total in window.totals.items()}

    def _comm_seconds(self, backward: float, launch: float | None) -> float:
        return self._sync_s + (backward - launch if launch is not None else 0.0)

    def _add(self, data: float, fwd_bwd: float, comm: float, optimizer: float) -> None:
        totals = self._window.totals
        totals["data"] += data
        totals["comm"] += comm
        totals["compute"] += max(0.0, fwd_bwd - comm)
        totals["optimizer"] += optimizer
