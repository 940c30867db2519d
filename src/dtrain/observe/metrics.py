"""The numbers behind each logged line, gathered from every rank in one collective.

During the window between log steps the training step only adds to device scalars (loss, finite
gradient norms and their count, steps GradScaler skipped) and counts samples on the host; the step
timer keeps its marks. At a log step `StepMetrics.take` gathers one small vector from every rank —
those sums, the rank's stop request, its own clock for the window and its time split — and turns it
into the record: global samples/s, the step-time breakdown, MFU, per-rank busy time and the ranks that
straggle. That gather is the only place the host waits for the device.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dtrain import distributed
from dtrain.config import Config
from dtrain.data import Batches
from dtrain.data.batch import num_tokens, real_tokens, split
from dtrain.observe import memory, perf
from dtrain.observe.memory import FIELDS as memory_fields
from dtrain.observe.perf import stragglers
from dtrain.observe.steptime import PHASES, StepTimer


class Layout(Protocol):
    """How the processes split the job (parallel.ParallelDims): its data-parallel count, and in words."""

    @property
    def dp(self) -> int: ...

    def describe(self) -> str: ...


class StepMetrics:
    @classmethod
    def for_run(
        cls,
        config: Config,
        device: torch.device,
        world_size: int,
        timer: StepTimer,
        module: torch.nn.Module,
        batches: Batches,
        loss_of: Callable,
        count_skips: bool,
        layout: Layout | None = None,
    ) -> StepMetrics:
        """The metrics of a run: FLOPs per sample counted (on the whole module: before it is sharded)
        where `monitor.flops` asks, or at "auto" where the device's peak is known (for MFU)."""
        monitor, training = config.monitor, config.training
        peak = perf.peak_flops(device, training.precision, monitor.peak_tflops, training.tf32)
        counted = monitor.flops == "yes" or (monitor.flops == "auto" and peak is not None)
        flops = perf.training_flops_per_sample(module, batches, loss_of) if counted else None
        hosts = distributed.hostnames()
        margin = monitor.straggler_margin
        metrics = cls(device, world_size, timer, hosts, flops, peak, margin, count_skips, layout.dp if layout else 0)
        # Said with the memory each rank holds: which dimensions the job splits it over.
        metrics.layout = layout.describe() if layout and world_size > 1 else None
        return metrics

    def __init__(
        self,
        device: torch.device,
        world_size: int,
        timer: StepTimer,
        hosts: list[str],
        flops_per_sample: float | None,
        peak_flops: float | None,
        straggler_margin: float,
        count_skips: bool = False,
        data_ranks: int = 0,
    ):
        self.loss_sum = torch.zeros((), device=device)  # added to every step, read only here
        self.norm_sum = torch.zeros((), device=device)  # finite norms only: a skipped fp16 step's is inf
        self.norm_count = torch.zeros((), device=device)
        self.skipped_sum = torch.zeros((), device=device)  # steps GradScaler skipped (fp16)
        self.count_skips = count_skips
        self.device = device
        self.world_size = world_size
        # The processes drawing distinct samples (0: all): a replica's tensor- and pipeline-parallel
        # processes see the same samples, which count once.
        self.data_ranks = data_ranks or world_size
        self.layout: str | None = None
        self.timer = timer
        self.hosts = hosts
        self.flops_per_sample = flops_per_sample
        self.peak_flops = peak_flops
        self.margin = straggler_margin
        self._steps = 0
        self._samples = 0
        # The training loss since the last evaluation (its train_loss): the windows taken since, and how much
        # of the window still open an evaluation already counted (so that the next one does not again).
        self._since_eval_sum = torch.zeros((), device=device, dtype=torch.float64)
        self._since_eval_steps = 0
        self._counted_sum = torch.zeros((), device=device)
        self._counted_steps = 0
        # Token data: positions from shapes on the host, the real tokens among them (padding left out)
        # on the device, gathered with the window.
        self._positions: int | None = None
        self.tokens_sum = torch.zeros((), device=device)
        self._start = time.perf_counter()
        self._paused_at: float | None = None
        self._windows = 0
        # A step left out of the rates (torch.compile's first): its samples, tokens and seconds.
        self._untimed: tuple[int, Tokens | None, float] | None = None
        # Measured in the first step (after_backward, after_update): this rank's (parameter, gradient,
        # optimizer-state) bytes and how to read its peak memory; sent with the next gather, then cleared.
        self.held: tuple[int, int, int] | None = None
        self.peak: Callable[[], tuple[int, str]] | None = None
        self._probe: str | None = "gradients"  # what the first step measures next; None once it has
        self._grad_bytes = 0

    def after_backward(self, module: torch.nn.Module) -> bool:
        """The step's backward is done; the first step's gradients are measured. Whether this was the
        first step's (then True, once)."""
        if self._probe != "gradients":
            return False
        self._grad_bytes, self._probe = memory.gradient_bytes(module), "state"
        return True

    def after_update(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer stepped; the first step's parameters and optimizer state (AdamW's exists now) are
        measured: what this rank holds goes out with the next log step."""
        if self._probe != "state":
            return
        params, state = memory.state_bytes(module, optimizer)
        self.held = (params, self._grad_bytes, state)
        self.peak = lambda: memory.peak_bytes(self.device)
        self._probe = None

    def restart(self) -> None:
        """Start the window afresh (set-up time is not training time)."""
        self._steps, self._samples, self._positions, self._start = 0, 0, None, time.perf_counter()
        self.tokens_sum.zero_()

    def add_grad_norm(self, norm: torch.Tensor) -> None:
        finite = torch.isfinite(norm)
        self.norm_sum += torch.where(finite, norm, 0.0)
        self.norm_count += finite

    def step_done(self, samples: int, tokens: Tokens | None = None) -> None:
        self._steps += 1
        self._samples += samples
        self._count_tokens(tokens, +1)

    def leave_out_of_rates(self, samples: int, tokens: Tokens | None, seconds: float) -> None:
        """The step just done (its time paused) does not count in samples/s and tokens/s: torch.compile's
        first step. Only a window holding no other step reports it, as the best figure there is."""
        self._samples -= samples
        self._count_tokens(tokens, -1)
        self._untimed = (samples, tokens, seconds)

    def _count_tokens(self, tokens: Tokens | None, sign: int) -> None:
        if tokens is not None:
            positions, real = tokens
            self._positions = (self._positions or 0) + sign * positions
            self.tokens_sum += sign * real

    def pause(self) -> None:
        """Evaluation and checkpoints do not count as training time."""
        self._paused_at = time.perf_counter()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Pause for what the block does (evaluation, a checkpoint), resume once it is done."""
        self.pause()
        yield
        self.resume()

    def resume(self) -> None:
        if self._paused_at is not None:
            self._start += time.perf_counter() - self._paused_at
            self._paused_at = None

    def take(self, stop_requested: bool) -> tuple[dict[str, Any], bool]:
        """The window's record (every rank gets the same) and whether any rank asked to stop."""
        untimed, self._untimed = self._untimed, None
        if untimed is not None and self._steps == 1:  # nothing else in the window: report what there is
            self._samples = untimed[0]
            self._count_tokens(untimed[1], +1)
            self._start -= untimed[2]
            untimed = None
        timed_steps = self._steps - (untimed is not None)
        phases = self.timer.take() if self.timer.enabled else None  # on CUDA: the window's work is done
        # This rank's own clock for the window, read before the gather: every step it timed lies inside
        # it, so the phases can never add up to more than the step time they break down.
        own_seconds = max(time.perf_counter() - self._start, 1e-9)
        split = [phases[p] for p in PHASES] if phases else []
        measured = self.held is not None and self.peak is not None
        held = (
            [*self.held, self.peak()[0]]
            if self.held is not None and self.peak is not None
            else [0.0] * len(memory_fields)
        )
        local = torch.tensor(
            [0.0, 0.0, 0.0, 0.0, 0.0, float(stop_requested), own_seconds, float(measured), *held, *split],
            dtype=torch.float64,
            device=self.device,
        )
        self._since_eval_sum += (self.loss_sum - self._counted_sum).double()
        self._since_eval_steps += self._steps - self._counted_steps
        self._counted_sum.zero_()
        self._counted_steps = 0
        for column, total in (
            (_LOSS, self.loss_sum),
            (_NORM, self.norm_sum),
            (_NORMS, self.norm_count),
            (_SKIPPED, self.skipped_sum),
            (_TOKENS, self.tokens_sum),
        ):
            local[column] += total.double()
            total.zero_()
        rows = _gather(local, self.world_size).tolist()  # the one host sync of the window

        now = time.perf_counter()
        seconds = max(now - self._start, 1e-9)  # rank 0's gather to gather: throughput over a run adds up
        per_step = max(self._steps, 1) * self.world_size
        samples_per_s = self._samples * self.data_ranks / seconds
        record: dict[str, Any] = {"loss": sum(r[_LOSS] for r in rows) / per_step}
        norms = sum(r[_NORMS] for r in rows)
        if norms:  # none when every step of the window was skipped
            record["grad_norm"] = sum(r[_NORM] for r in rows) / norms
        if self.count_skips:  # gradients are synchronised: every rank skips the same steps
            record["skipped_steps"] = int(max(r[_SKIPPED] for r in rows))
        record["samples_per_s"] = samples_per_s
        # Real tokens (padding left out), which MFU counts too: padded positions are work not asked for.
        real_share = 1.0
        if self._positions is not None:
            tokens = sum(r[_TOKENS] for r in rows) * self.data_ranks / self.world_size
            record["tokens_per_s"] = tokens / seconds
            real_share = tokens / max(self._positions * self.data_ranks, 1)
        stop = any(r[_STOP] > 0 for r in rows)
        if all(r[_MEASURED] for r in rows):  # once: the first log step after each rank measured its own
            record.update({name: [int(r[_MEMORY0 + i]) for r in rows] for i, name in enumerate(memory_fields)})
            if self.layout:
                record["layout"] = self.layout
            self.held = self.peak = None
        if phases is not None:
            record.update(self._breakdown(rows, timed_steps))
        if self.timer.bubble is not None:  # a pipeline's idle share of a step, by its schedule
            record["pp_bubble"] = self.timer.bubble
        self._windows += 1
        if self.flops_per_sample is not None:
            record["flops_per_sample"] = self.flops_per_sample
            if self.peak_flops:
                achieved = self.flops_per_sample * samples_per_s * real_share
                record["mfu"] = achieved / (self.world_size * self.peak_flops)
        self._steps, self._samples, self._positions, self._start = 0, 0, None, now
        return record, stop

    def since_eval(self) -> dict[str, float]:
        """`train_loss`: the mean training loss over every rank's steps since the last evaluation (nothing when
        none ran), an estimate of the model's training loss beside its eval loss. A collective: every rank
        evaluates at the same steps."""
        total = self._since_eval_sum + (self.loss_sum - self._counted_sum).double()
        steps = self._since_eval_steps + self._steps - self._counted_steps
        self._counted_sum.copy_(self.loss_sum)
        self._counted_steps = self._steps
        self._since_eval_sum.zero_()
        self._since_eval_steps = 0
        summed = _gather(total.reshape(1), self.world_size).sum().item()
        return {"train_loss": summed / (steps * self.world_size)} if steps else {}

    def _breakdown(self, rows: list[list[float]], steps: int) -> dict[str, Any]:
        def mean(column: int) -> float:
            return sum(r[column] for r in rows) / len(rows)

        phase = {p: _PHASE0 + i for i, p in enumerate(PHASES)}
        busy = [r[phase["data"]] + r[phase["compute"]] + r[phase["optimizer"]] for r in rows]  # not waiting
        # The first window holds one-off warm-up work (kernel selection, allocator growth): not judged.
        slow = stragglers(busy, self.margin) if self._windows > 0 else []
        out: dict[str, Any] = {
            "step_ms": 1000 * mean(_OWN_SECONDS) / max(steps, 1),
            **{
                f"{p}_ms": mean(column)
                for p, column in phase.items()
                if not (p == "comm" and self.timer.comm_inside_compute)
            },  # counted as compute, not 0
            "rank_busy_ms": busy,
        }
        if slow:
            out["stragglers"] = [{"rank": r, "host": self.hosts[r], "slower": share} for r, share in slow]
        return out


Tokens = tuple[int, torch.Tensor]  # a step's token positions (from shapes), the real tokens among them


def step_tokens(micro_batches: list[Any]) -> Tokens | None:
    """A step's token positions and real tokens (on the device: no host sync), or None for data that
    is not token sequences."""
    positions = [num_tokens(split(batch)[1]) for batch in micro_batches]
    if not positions or None in positions:
        return None
    real = torch.stack([real_tokens(batch) for batch in micro_batches]).sum()
    return sum(p for p in positions if p is not None), real


# Columns of the vector each rank contributes to the gather.
_LOSS, _NORM, _NORMS, _SKIPPED, _TOKENS, _STOP, _OWN_SECONDS, _MEASURED, _MEMORY0 = range(9)
_PHASE0 = _MEMORY0 + len(memory_fields)


def _gather(local: torch.Tensor, world_size: int) -> torch.Tensor:
    if world_size == 1 or not dist.is_initialized():
        return local.unsqueeze(0)
    rows = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(rows, local)
    return torch.stack(rows)
