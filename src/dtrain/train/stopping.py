"""SIGTERM (a scheduler preempting the job) asks the run to stop at the next point the ranks agree on.

The handler only sets a flag: the step in flight finishes, the ranks agree at the next logging
all-reduce (every `training.log_every` steps, sooner where steps are slow: StopAgreement.pace, agreed
again at every log step; every step in a one-process run), write one checkpoint and exit with
EXIT_REQUEUE. `training.stop_at_step` stops a run at a planned step instead (StopAgreement.step_reached).

The same flag stops a run whose run.dir another run took over (rank 0's lease on an object store lost,
see rundir/lease.py): agreed at the same points, but then every rank raises RunDirLost (exit 73) at once,
with no checkpoint: nothing more may be written there.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path

from dtrain import distributed, early_stop
from dtrain.config import CheckpointConfig, TrainingConfig
from dtrain.errors import Preempted, RunDirLost


class StopRequest:
    """SIGTERM sets `requested`, from `install()` (before anything is written to run.dir) to `uninstall()`."""

    def __init__(self):
        self.requested = False
        self.run_dir_lost = ""  # the line saying why run.dir is no longer this run's (see lose_run_dir)
        self._previous = None

    def lose_run_dir(self, line: str) -> None:
        """From the lease's thread: run.dir is another run's now; stop as on SIGTERM, but write nothing."""
        self.run_dir_lost = line
        self.requested = True

    def install(self) -> None:
        # Signals reach the main thread only; installed twice (set-up, then fit) it stays one handler.
        if threading.current_thread() is threading.main_thread() and self._previous is None:
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def uninstall(self) -> None:
        if self._previous is not None:
            # The command line's early handler says "before training began": past training, the default.
            previous = signal.SIG_DFL if early_stop.installed(self._previous) else self._previous
            signal.signal(signal.SIGTERM, previous)
            self._previous = None

    def __enter__(self) -> StopRequest:
        self.install()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.uninstall()

    def _handle(self, signum, frame) -> None:
        self.requested = True


class StopAgreement:
    """When the group stops before its planned end, every rank at the same step: on SIGTERM (this rank's
    `request`, agreed at log steps and, for slow steps, between them) or at `training.stop_at_step`."""

    def __init__(
        self,
        training: TrainingConfig,
        checkpoint: CheckpointConfig,
        world_size: int,
        request: StopRequest | None = None,
    ):
        self.training, self.checkpoint, self.world_size = training, checkpoint, world_size
        self.request = request or StopRequest()
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
        return Preempted(
            f"stopped by SIGTERM at step {step}; checkpoint written to {checkpoints}/step-{step}; rerun the "
            f"same command to resume"
        )

    def preempted_before_training(self, step: int) -> Preempted:
        if step == 0:
            return Preempted(early_stop.NOTHING_TO_SAVE)
        return Preempted(
            f"{early_stop.BEFORE_TRAINING}; checkpoint step-{step} is still the newest — rerun the same command "
            f"to resume"
        )

    def stopped_early(self, step: int, first_step: int) -> str:
        """The console line for a run that stopped at `training.stop_at_step`."""
        if step > first_step:
            return f"stopped at step {step} as training.stop_at_step asks; resume to continue"
        return (
            f"training.stop_at_step={self.training.stop_at_step} and the run is at step {step} already: "
            f"nothing trained; rerun without it (or with a later step) to continue"
        )
