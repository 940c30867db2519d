"""Checkpoints: scheduled and on preemption, atomic, verified, resumed exactly.

`Checkpointer` is what the trainer talks to; `store` knows the folders, `state` what goes in them,
`manifest` what seals one; `export` the final weights.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dtrain.checkpoint.state import Parts, Position, regroup
from dtrain.checkpoint.store import Checkpoint, CheckpointError, CheckpointStore, describe_failure, marker_problem
from dtrain.config import CheckpointConfig, Config
from dtrain.distributed import first_error, from_rank0, later_attempt
from dtrain.files import atomic_write_text

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointStore",
    "Checkpointer",
    "Parts",
    "Position",
    "resume_geometry",
    "truncate_metrics",
]


class Checkpointer:
    """Saves and restores `parts` under `<run_dir>/checkpoints`. Every method is called on every rank;
    rank 0 alone touches the folder structure."""

    def __init__(self, config: CheckpointConfig, run_dir: Path, parts: Parts):
        self.config = config
        self.store = CheckpointStore(run_dir)
        self.parts = parts
        self.is_main = parts.rank == 0
        self.last_saved_step: int | None = None

    def due(self, step: int, *, last: bool, forced: bool) -> bool:
        """The save policy, in one place (every rank decides alike). After step `step`, a checkpoint is
        written when the run stops early (`forced`: SIGTERM, training.stop_at_step), every
        `checkpoint.every_steps` steps, and at the `last` step when checkpoints are scheduled or this
        run has one (a rerun would resume from it and train the end again) — never twice for a step."""
        if step == self.last_saved_step:
            return False
        every = self.config.every_steps
        scheduled = bool(every) and step % every == 0
        return forced or scheduled or (last and (bool(every) or self.last_saved_step is not None))

    def find_resume_point(self) -> Checkpoint | None:
        """The checkpoint this run continues from, per `checkpoint.resume` (all ranks agree)."""
        answer: tuple[int | None, str | None] = (None, None)
        if self.is_main:
            try:
                self.store.remove_partials()
                checkpoint = self._choose()
                if checkpoint is not None:
                    self.store.check_intact(checkpoint)
                answer = (checkpoint.step if checkpoint else None, None)
            except CheckpointError as exc:
                answer = (None, str(exc))
        step, error = from_rank0(answer)
        if error:
            raise CheckpointError(error)
        return None if step is None else Checkpoint(step, self.store.root / f"step-{step}")

    def _choose(self) -> Checkpoint | None:
        # A restarted group always continues where the failed one left off.
        return choose_resume(self.store, "auto" if later_attempt() else self.config.resume)

    def restore(self, checkpoint: Checkpoint) -> Position:
        from dtrain.checkpoint.tensors import load

        position = load(checkpoint.path, self.parts)
        self.last_saved_step = position.step
        return position

    def save(self, position: Position) -> Checkpoint:
        """Write checkpoint `position.step` (collective). A failure on any rank leaves the previous
        checkpoints untouched, removes the partial one and raises on every rank."""
        from torch.distributed.checkpoint.api import CheckpointException

        from dtrain.checkpoint.tensors import save

        step = position.step
        error = None
        if self.is_main:
            try:
                self.store.begin(step)
            except OSError as exc:
                error = describe_failure(exc)
        error = first_error(error)  # also: the folder exists for everyone
        meta = None
        if error is None:
            try:
                meta = save(self.store.partial_path(step), self.parts, position)
            except (Exception, CheckpointException) as exc:
                error = f"rank {self.parts.rank}: {_space_hint(self.store) or describe_failure(exc)}"
            error = first_error(error)
        checkpoint = Checkpoint(step, self.store.root / f"step-{step}")
        if error is None and self.is_main:
            try:
                checkpoint = self.store.commit(step, meta)
                self.store.prune(self.config.keep)
            except OSError as exc:
                error = describe_failure(exc)
        if error is not None:
            if self.is_main:
                self.store.abandon(step)
            newest = self.store.newest()
            kept = f"; {newest.name} is intact" if newest else ""
            raise CheckpointError(
                f"could not write checkpoint step-{step} in {self.store.root}: {error}"
                f"{kept}; free space or choose another run.dir"
            )
        self.last_saved_step = step
        return checkpoint


def choose_resume(store: CheckpointStore, mode: str) -> Checkpoint | None:
    """The checkpoint `checkpoint.resume = mode` continues from, or a refusal."""
    newest = store.newest()
    if mode == "no" and newest is not None:
        raise CheckpointError(
            f"run.dir {store.root.parent} already holds checkpoints (newest {newest.name}); continue "
            f"that run with --resume (or checkpoint.resume=auto), replace it with run.overwrite=true, or choose "
            f"another run.dir"
        )
    if mode == "yes" and newest is None:
        raise CheckpointError(
            f"--resume: {store.root} holds no complete checkpoint to continue from (the run "
            f"stopped before its first); start afresh with run.overwrite=true instead of --resume"
        )
    return newest if mode != "no" else None


def resume_geometry(
    config: CheckpointConfig, run_dir: Path, fresh: bool = False, verify: bool = False
) -> tuple[str, int, int] | None:
    """(name, world size, samples per process per step) of the checkpoint a run would continue from,
    read from its marker without touching anything (`verify`: every file checked against it too);
    None for a fresh start, or a marker the resume itself will judge."""
    if fresh:
        return None
    store = CheckpointStore(run_dir)
    checkpoint = choose_resume(store, "auto" if later_attempt() else config.resume)
    if checkpoint is None:
        return None
    if verify:
        meta = store.check_intact(checkpoint)
    else:
        try:
            meta = checkpoint.meta()
        except (OSError, ValueError):
            return None
        if marker_problem(meta, checkpoint.step):
            return None
    return checkpoint.name, meta.get("world_size", 1), meta.get("samples_per_step", 0)


def preflight(
    config: Config, run_dir: Path, world_size: int, global_order: bool | None, fresh: bool = False
) -> str | None:
    """What the launcher can refuse before starting workers: a resume that cannot happen, a damaged
    checkpoint, one whose global batches this world cannot take (see `regroup`). The checkpoint the run
    will continue from (None: a fresh start). `fresh`: the run starts afresh whatever run.dir holds."""
    saved = resume_geometry(config.checkpoint, run_dir, fresh, verify=True)
    if saved is None:
        return None
    name, saved_world, saved_per_rank = saved
    if saved_per_rank:  # markers before 0.3 did not say; the workers check the checkpoint itself
        regroup(
            name,
            saved_world,
            saved_per_rank,
            world_size,
            config.data.batch_size,
            config.training.grad_accum_steps,
            global_order,
        )
    return name


def _space_hint(store: CheckpointStore) -> str:
    """Name a full disk when that is the cause (torch.save reports it only as a write-position error)."""
    try:
        stats = os.statvfs(store.root)
    except OSError:
        return ""
    free = stats.f_bavail * stats.f_frsize
    newest = store.newest()
    if newest is None:  # no checkpoint to size one by: only a nearly full disk is named
        return f"No space left on device ({free:,} bytes free)" if free < 1 << 20 else ""
    needed = sum(f["bytes"] for f in newest.meta()["files"].values())
    if free < needed:
        return f"No space left on device ({free:,} bytes free, a checkpoint takes about {needed:,})"
    return ""


def truncate_metrics(path: Path, step: int, drop_eval_at_step: bool) -> None:
    """Drop what an interrupted run logged after the checkpoint it resumes from (and its eval at that
    step when the resumed run evaluates it again), so the file reads as one run."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by the interruption
        at = record.get("step", 0)
        if at < step or (at == step and not ("eval_loss" in record and drop_eval_at_step)):
            kept.append(line)
    atomic_write_text(path, "".join(f"{line}\n" for line in kept))
