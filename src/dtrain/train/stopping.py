"""SIGTERM (a scheduler preempting the job) or Ctrl-C (a person) asks the run to stop at the next point the
ranks agree on.

The handler only sets a flag: the step in flight finishes, the ranks agree at the next logging
all-reduce (every `training.log_every` steps, sooner where steps are slow: StopAgreement.pace, agreed
again at every log step; every step in a one-process run), write one checkpoint and exit with
EXIT_REQUEUE (75; after Ctrl-C, 130: Interrupted). A second Ctrl-C ends the process at once, saying what
a rerun will do (StopRequest.abandon_line). `training.stop_at_step` stops a run at a planned step instead
(StopAgreement.step_reached).

The same flag stops a run whose run.dir another run took over (rank 0's lease on an object store lost,
see rundir/lease.py): agreed at the same points, but then every rank raises RunDirLost (exit 73) at once,
with no checkpoint: nothing more may be written there."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from dtrain import distributed, early_stop
from dtrain.checkpoint import CheckpointStore
from dtrain.config import CheckpointConfig, TrainingConfig
from dtrain.errors import EXIT_INTERRUPTED, Interrupted, Preempted, RunDirLost

ABANDONED_BEFORE_TRAINING = "interrupted again before training began; nothing to save — rerun the same command to start"


def abandoned(step: int, store: CheckpointStore) -> str:
    """A second Ctrl-C's line: where the run stopped, and what the same command will do then."""
    newest = store.newest()
    if newest is not None and newest.step == step:
        return f"interrupted again at step {step}: stopped at once; the same command resumes from {newest.name}"
    then = f"resumes from {newest.name}" if newest else "starts the run again from its first step"
    return f"interrupted again at step {step}: stopped at once, without a checkpoint of it; the same command {then}"


class StopRequest:
    """SIGTERM or Ctrl-C (SIGINT) sets `requested`, from `install()` (before anything is written to run.dir) to
    `uninstall()`. A second Ctrl-C stops at once: `abandon` says what a rerun will then do, and the process
    ends with 130."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested = False
        self.terminated = False  # by SIGTERM: a scheduler's preemption, exit 75
        self.interrupts = 0  # Ctrl-Cs: the first stops as SIGTERM does (exit 130), the second at once
        self.run_dir_lost = ""  # the line saying why run.dir is no longer this run's (see lose_run_dir)
        # A second Ctrl-C's line (what a rerun will do), said by rank 0 only; set once run.dir is known.
        self.abandon_line: Callable[[], str | None] = lambda: ABANDONED_BEFORE_TRAINING
        self._previous: dict[int, Any] = {}

    @property
    def interrupted(self) -> bool:
        """Stopped by Ctrl-C and not by a scheduler (whose SIGTERM asks for a requeue, 75)."""
        return self.interrupts > 0 and not self.terminated

    def lose_run_dir(self, line: str) -> None:
        """From the lease's thread: run.dir is another run's now; stop as on SIGTERM, but write nothing."""
        self.run_dir_lost = line
        self.requested = True

    def install(self) -> None:
        # Signals reach the main thread only; installed twice (set-up, then fit) it stays one handler.
        if threading.current_thread() is threading.main_thread() and not self._previous:
            self._previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}

    def uninstall(self, error: BaseException | None = None, finished: bool = False) -> None:
        """The handlers before `install()` back — in a dtrain worker (whose early handler says "before
        training began") those for the end of its process (early_stop.past_training): after a run that
        `finished`, or stopped with its checkpoint (`error` a Preempted)."""
        for signum, previous in self._previous.items():
            if early_stop.installed(previous):
                previous = early_stop.past_training(signum, finished, isinstance(error, Preempted))
            signal.signal(signum, previous)
        self._previous = {}

    def __enter__(self) -> StopRequest:
        self.install()
        return self

    def __exit__(self, kind: object, error: BaseException | None, trace: object) -> None:
        self.uninstall(error, finished=error is None)

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                self._abandon()
        else:
            self.terminated = True
        self.requested = True

    def _abandon(self) -> NoReturn:
        """The second Ctrl-C: end now, mid-step or mid-write (a checkpoint being written stays partial and
        is never chosen; the sealed ones are untouched), rank 0 saying what the same command will do."""
        try:
            line = self.abandon_line()
            if line:
                print(f"dtrain: {line}", file=sys.stderr, flush=True)
        except Exception:  # a console gone (or run.dir unreadable) is no reason to stay
            pass
        os._exit(EXIT_INTERRUPTED)


class StopAgreement:
    """When the group stops before its planned end, every rank at the same step: on SIGTERM (this rank's
    `request`, agreed at log steps and, for slow steps, between them) or at `training.stop_at_step`."""

    def __init__(
        self,
        training: TrainingConfig,
        checkpoint: CheckpointConfig,
        world_size: int,
        request: StopRequest | None = None,
        is_main: bool = True,
    ):
        self.training, self.checkpoint, self.world_size = training, checkpoint, world_size
        self.request = request or StopRequest()
        self.is_main = is_main  # says the stop's line where a script lets the stop through (said_if_uncaught)
        self.check_every = training.log_every  # steps between agreements off log steps: see pace
        self.left_together = False  # every rank raised RunDirLost at the same step

    def step_reached(self, step: int, total_steps: int) -> bool:
        """Whether the run has reached `training.stop_at_step` — or its end, where that lies beyond it (a
        checkpoint is written there too, so the command without it continues or finds the run complete)."""
        stop_at = self.training.stop_at_step
        return stop_at > 0 and step >= min(stop_at, total_steps)

    def decide(self, stop: bool, step: int, total: int) -> tuple[bool, bool]:
        """(whether the group stops at `step` as on SIGTERM, whether at training.stop_at_step). `stop`: a
        stop agreed (at the last step the run's end writes its checkpoint instead). Where rank 0 lost
        run.dir, every rank raises RunDirLost here, before any checkpoint: one more gather, only on a stop."""
        if stop:
            lost = self.request.run_dir_lost
            lost = max(distributed.gather_objects(lost)) if self.world_size > 1 else lost
            if lost:
                self.left_together = True
                raise RunDirLost(f"{lost}; this run stopped at step {step} and wrote nothing more there")
        return stop and step < total, self.step_reached(step, total)

    def requested_by_any(self) -> bool:
        """Whether any rank got SIGTERM so far (one gather): asked before the first step (a SIGTERM
        during set-up stops the group there) and after the last (see Trainer._train)."""
        if self.world_size == 1:
            return self.request.requested
        return any(distributed.gather_objects(self.request.requested))

    def between_log_steps(self, step: int) -> bool:
        """At a step that logs nothing, whether the group stops (SIGTERM): a lone process has nobody to
        agree with and checks every step; slow steps agree every `check_every` steps (see pace)."""
        if self.world_size == 1:
            return self.request.requested
        if step % self.check_every == 0:
            return any(distributed.gather_objects(self.request.requested))
        return False

    def pace(self, seconds: float) -> None:
        """After SIGTERM the ranks must agree to stop, and write the checkpoint, within
        `checkpoint.preempt_grace_s`. They agree at log steps; where `training.log_every` steps of this
        run's pace (first the slowest rank's second step, agreed here: a collective; then each logged
        window's, see repace) would take more than a quarter of that grace, they also agree every so
        many steps between — one tiny gather per that many slow steps. Fast steps keep log steps as the
        only agreement."""
        if self.world_size > 1 and self.training.log_every > 1:
            self._keep_pace(max(distributed.gather_objects(seconds)))

    def repace(self, record: dict) -> None:
        """At a log step, the pace agreed again from the window just logged, so that steps that slow down
        later in a run (longer sequences, a slower node, a busier disk) are agreed on often enough from
        the next window on, and steps that sped up less often. The record's step time came out of the
        log step's gather and is the same on every rank: every rank takes the same decision here
        without a collective of its own. (Without `monitor.breakdown` there is none: the pace stays.)"""
        step_ms = record.get("step_ms")
        if self.world_size > 1 and self.training.log_every > 1 and isinstance(step_ms, float):
            self._keep_pace(step_ms / 1000)

    def _keep_pace(self, seconds: float) -> None:
        affordable = int(self.checkpoint.preempt_grace_s / 4 / max(seconds, 1e-6))
        self.check_every = max(1, min(self.training.log_every, affordable))

    def preempted(self, step: int, checkpoints: Path) -> Preempted:
        interrupted = self.request.interrupted
        kind, how = (Interrupted, "interrupted (Ctrl-C)") if interrupted else (Preempted, "stopped by SIGTERM")
        where = f"checkpoint written to {checkpoints}/step-{step}"
        return said_if_uncaught(kind(f"{how} at step {step}; {where}; rerun the same command to resume"), self.is_main)

    def preempted_before_training(self, step: int) -> Preempted:
        interrupted = self.request.interrupted
        kind = Interrupted if interrupted else Preempted
        if step == 0:
            line = early_stop.NOTHING_TO_SAVE_INTERRUPTED if interrupted else early_stop.NOTHING_TO_SAVE
        else:
            before = early_stop.INTERRUPTED_BEFORE_TRAINING if interrupted else early_stop.BEFORE_TRAINING
            line = f"{before}; checkpoint step-{step} is still the newest — rerun the same command to resume"
        return said_if_uncaught(kind(line), self.is_main)

    def stopped_early(self, step: int, first_step: int) -> str:
        """The console line for a run that stopped at `training.stop_at_step`."""
        if step > first_step:
            return f"stopped at step {step} as training.stop_at_step asks; resume to continue"
        return (
            f"training.stop_at_step={self.training.stop_at_step} and the run is at step {step} already: "
            f"nothing trained; rerun without it (or with a later step) to continue"
        )


def said_if_uncaught(stop: Preempted, is_main: bool) -> Preempted:
    """`stop`, which ends the run's process as `dtrain run` ends it if the script lets it through uncaught
    (plain torchrun or python, where no dtrain worker wrapper catches it): rank 0's one line, the stop's
    exit status (75, or 130 after Ctrl-C), no traceback on any rank. Any other exception, or this one
    caught by the script, is left to the script and Python as before."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, trace: Any) -> None:
        if value is not stop:
            previous(kind, value, trace)
            return
        if is_main:
            print(f"dtrain: {value}", file=sys.stderr, flush=True)
        distributed.end_worker_process(stop.exit_code)

    sys.excepthook = hook
    return stop
