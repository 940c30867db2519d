"""`Checkpointer`: what the trainer talks to — when to save (`due`, `at_end`), saving (synchronous or in the
background, sealed on every rank's agreement), finding and restoring the checkpoint a run continues from."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from dtrain.checkpoint.best import BestKeeper
from dtrain.checkpoint.pending import PendingCheckpoint, completed
from dtrain.checkpoint.state import Parts, Position
from dtrain.checkpoint.store import Checkpoint, CheckpointError, CheckpointStore, check_intact, describe_failure
from dtrain.config import CheckpointConfig
from dtrain.distributed import every_rank_raises, rank0_decides
from dtrain.errors import DtrainError

if TYPE_CHECKING:
    from dtrain.checkpoint.remote import RemoteCheckpointStore


class Checkpointer:
    """Saves and restores `parts` under `<run_dir>/checkpoints`. Every method is called on every rank;
    rank 0 alone touches the folder structure. `remote`: run.dir is on an object store and `run_dir` its
    local staging folder; a checkpoint is sealed on the store first (checkpoint/on_store.py), and each
    node's leader writes its own staging folder."""

    def __init__(
        self, config: CheckpointConfig, run_dir: Path, parts: Parts, remote: RemoteCheckpointStore | None = None
    ):
        from dtrain.checkpoint.on_store import StoreSealing

        self.config = config
        self.store = CheckpointStore(run_dir)
        self.parts = parts
        self.is_main = parts.rank == 0
        self.on_store = StoreSealing(remote, self.store, parts.rank) if remote is not None else None
        self.last_saved_step: int | None = None  # the newest sealed
        # Where each sealed checkpoint's record goes (the trainer's monitor: metrics.jsonl and the console).
        self.report: Callable[[dict[str, Any]], None] | None = None
        self._in_flight: PendingCheckpoint | None = None  # checkpoint.async: the one being written
        self._background: Any = None  # its BackgroundWriter, from the first background save on
        self.best = BestKeeper(config.keep_best, self.store.root, self.is_main)  # spared by pruning

    def due(self, step: int, *, last: bool, forced: bool) -> bool:
        """The save policy, in one place (every rank decides alike). After step `step`, a checkpoint is
        written when the run stops early (`forced`: SIGTERM, training.stop_at_step), every
        `checkpoint.every_steps` steps, and at the `last` step when checkpoints are scheduled or this run has
        one (a rerun would resume from it and train the end again) — never twice for a step. The end's own
        checkpoint (`checkpoint.at_end`) comes after the final weights: see `at_end`."""
        if step == self.last_saved_step:
            return False
        if self._in_flight is not None and self._in_flight.step == step:
            return forced  # a stop right after it: `checkpoint` sees it sealed
        every, epochs = self.config.every_steps, self.config.every_epochs
        per_epoch = self.parts.plan.get("steps_per_epoch", 0)
        scheduled = bool(every) and step % every == 0
        # checkpoint.every_epochs: at the end of every such epoch (its last step, before it evaluates)
        scheduled |= bool(epochs and per_epoch) and step % per_epoch == 0 and (step // per_epoch) % epochs == 0
        return forced or scheduled or (last and (bool(every or epochs) or self.last_saved_step is not None))

    def at_end(self, step: int) -> bool:
        """Whether the run's end, `step`, still needs its checkpoint (`checkpoint.at_end`): written after the
        final weights, so that a disk too full for both keeps the weights (export.write_final_weights)."""
        return self.config.at_end and self.last_saved_step != step

    def consider_best(self, step: int, record: dict[str, Any]) -> None:
        """checkpoint.keep_best, after the evaluation at `step` (on every rank: a missing metric stops all)."""
        in_flight = self._in_flight is not None and self._in_flight.step == step
        self.best.consider(step, record, checkpointed=step == self.last_saved_step or in_flight)

    def find_resume_point(self, choose_in: Callable[[CheckpointStore], Checkpoint | None]) -> Checkpoint | None:
        """The checkpoint this run continues from, as `choose_in` picks it from run.dir's own or another
        (rundir/resume_point.py: `checkpoint.resume`, --resume-from); all ranks agree on rank 0's choice."""

        def choose() -> tuple[int, str] | None:
            self.store.remove_partials()
            checkpoint = choose_in(self.store)
            ours = checkpoint is not None and checkpoint.path.parent.resolve() == self.store.root.resolve()
            if checkpoint is not None and not (ours and self.on_store is not None):
                check_intact(checkpoint, self.store)
            # run.dir's own by its step (each rank's staging folder may be another path), --resume-from's by path
            return (checkpoint.step, "" if ours else str(checkpoint.path)) if checkpoint else None

        chosen = _as_checkpoint_error(lambda: rank0_decides(choose, is_main=self.is_main))
        if chosen is None:
            own, checkpoint = None, None
        else:
            own = None if chosen[1] else chosen[0]
            checkpoint = Checkpoint(chosen[0], Path(chosen[1]) if chosen[1] else self.store.root / f"step-{chosen[0]}")
        if self.on_store is not None:  # every node's copy of run.dir's own fetched whole from the store, then checked
            on_store = self.on_store
            on_store.find_leaders()
            _as_checkpoint_error(lambda: on_store.localize(own))
            if own is not None and checkpoint is not None:
                checked = checkpoint
                _as_checkpoint_error(lambda: rank0_decides(lambda: self._checked(checked), is_main=self.is_main))
        return checkpoint

    def _checked(self, checkpoint: Checkpoint) -> None:
        self.store.check_intact(checkpoint)

    def restore(self, checkpoint: Checkpoint) -> Position:
        from dtrain.checkpoint.tensors import load

        position = load(checkpoint.path, self.parts)
        if self.is_main:
            for note in position.notes:
                print(note, file=sys.stderr, flush=True)
        self.last_saved_step = position.step
        return position

    def checkpoint(self, position: Position, *, wait: bool = False) -> None:
        """The trainer's checkpoint after step `position.step` (collective), reported once sealed: written
        and sealed now, or with `checkpoint.async` (unless `wait`: SIGTERM, after the run) copied to host
        memory now and written in the background. One in flight is finished first — at most one at a time,
        the wait counted as this checkpoint's blocked time — and if it was this step's, that is all."""
        began = time.perf_counter()
        self.finish(position.step)
        if self.last_saved_step == position.step:
            return
        background, writing = bool(self.config.async_) and not wait, time.perf_counter()
        pending = self.start_save(position, background=background)
        if background:
            pending.blocked_s, self._in_flight = time.perf_counter() - began, pending
            return
        pending.wait()
        pending.blocked_s, pending.write_s = time.perf_counter() - began, time.perf_counter() - writing
        self._said(pending, position.step)

    def poll(self, step: int) -> None:
        """Report the checkpoint in flight if this rank sees it sealed (not collective: each rank at its own
        step). A failed one is left for `finish`, where every rank raises it together."""
        if self._in_flight is not None and self._in_flight.done and self._in_flight.sealed:
            self.finish(step)

    def finish(self, step: int, last: bool = False) -> None:
        """Wait for the checkpoint in flight, if any, and report it at step `step`; its failure is raised on
        every rank (every rank calls it at the same step: its thread has agreed the outcome with the others).
        `last`: no background write follows (training is over), its host copy is let go."""
        pending, self._in_flight = self._in_flight, None
        try:
            if pending is not None:
                pending.wait()
                self._said(pending, step)
        finally:
            if last and self._background is not None:
                self._background.close()
                self._background = None

    def _said(self, pending: PendingCheckpoint, step: int) -> None:
        if self.report is not None:
            blocked, write = round(pending.blocked_s, 4), round(pending.write_s, 4)
            name = f"step-{pending.step}"
            record = {
                "step": step,
                "time": time.time(),
                "checkpoint": name,
                "checkpoint_background": pending.background,
            }
            self.report({**record, "checkpoint_blocked_s": blocked, "checkpoint_write_s": write})

    def save(self, position: Position) -> Checkpoint:
        """Write checkpoint `position.step` and seal it (collective), after finishing the one in flight:
        `start_save(position).wait()`."""
        self.finish(position.step)
        return self.start_save(position).wait()

    def start_save(self, position: Position, background: bool = False) -> PendingCheckpoint:
        """Begin writing checkpoint `position.step` (collective); its `wait()` seals it. A failure on any
        rank leaves the previous checkpoints untouched, removes the partial one and raises on every rank:
        here, or in `wait()`. A part that cannot be saved (a value neither tensor nor JSON) is refused
        before anything is written. `background`: the tensors are copied to host memory here and written
        while training goes on, and the writing thread seals the checkpoint (checkpoint/pending.py)."""
        from dtrain.checkpoint.tensors import stage, write

        step = position.step
        refusal = failure = None
        try:
            staged = stage(self.parts, position)
        except CheckpointError as exc:
            refusal = f"checkpoint step-{step} cannot be written: {exc}"
        except Exception as exc:
            failure = f"rank {self.parts.rank}: {describe_failure(exc)}"
        _as_checkpoint_error(lambda: every_rank_raises(refusal))

        def begin() -> None:
            try:
                self.store.begin(step)
                if self.on_store is not None:
                    self.on_store.begin(step)
            except DtrainError:
                raise
            except Exception as exc:  # OSError, or a store's client: every rank must hear of it
                raise DtrainError(describe_failure(exc)) from None

        try:
            every_rank_raises(failure)
            if self.on_store is not None:
                self.on_store.find_leaders()
            rank0_decides(begin, is_main=self.is_main)  # also: the folder exists for everyone
            if self.on_store is not None:  # and on every other node
                self.on_store.begin_on_nodes(step)
        except DtrainError as exc:
            raise self._failed(step, str(exc)) from None
        folder = self.store.partial_path(step)
        if background:
            return self._start_in_background(step, folder, staged)
        return PendingCheckpoint(step, completed(lambda: write(folder, staged, self.parts)), partial(self._seal, step))

    def _start_in_background(self, step: int, folder: Path, staged: Any) -> PendingCheckpoint:
        """Write the small files and copy the tensors to host memory now (every rank agreeing they could:
        the write's collectives must find every rank there), then write the copy in the background."""
        from dtrain.checkpoint.background import BackgroundWriter, on_gpu
        from dtrain.checkpoint.tensors import TENSORS, write_files

        if self._background is None:
            self._background = BackgroundWriter(on_gpu(self.parts.module))
        writer, failure = self._background, None
        try:
            meta = write_files(folder, staged, self.parts)
            copy = writer.stage(staged.tensors)
        except Exception as exc:
            failure = f"rank {self.parts.rank}: {_space_hint(self.store) or describe_failure(exc)}"
        try:
            every_rank_raises(failure)
        except DtrainError as exc:
            raise self._failed(step, str(exc)) from None
        written: Future[dict[str, Any]] = Future()
        tensors = writer.write(copy, folder / TENSORS, no_dist=self.parts.world_size == 1)
        tensors.add_done_callback(lambda done: _pass_on(done, written, meta))
        return PendingCheckpoint(step, written, partial(self._seal, step, group=writer.group), background=True)

    def _seal(self, step: int, written: Future[dict[str, Any]], group: Any = None) -> Checkpoint:
        """Seal checkpoint `step` once every rank's write has completed (collective, on `group`; rank 0
        alone touches the folders): its manifest, the rename into place, the pruning of the oldest. On a
        store, every node's files are sent there and COMPLETE.json written there before any folder is sealed."""
        from torch.distributed.checkpoint.api import CheckpointException

        error = None
        meta: dict[str, Any] = {}
        files: dict[str, dict[str, int]] | None = None
        try:
            meta = written.result()
        except (Exception, CheckpointException) as exc:
            error = f"rank {self.parts.rank}: {_space_hint(self.store) or describe_failure(exc)}"

        def commit() -> str | None:
            try:
                marker = None
                if self.on_store is not None and files is not None:
                    marker = self.on_store.seal(step, meta, files)  # the checkpoint exists from here on
                self.store.commit(step, meta, marker)
                self.store.prune(self.config.keep, spare=self.best.step())
                if self.on_store is not None:
                    self.on_store.prune(self.config.keep, spare=self.best.step())
                return marker
            except DtrainError:
                raise
            except Exception as exc:  # OSError, or a store's client: every rank must hear of it
                raise DtrainError(describe_failure(exc)) from None

        try:
            every_rank_raises(error, group)
            if self.on_store is not None:
                files = self.on_store.send(step, group)
            marker = rank0_decides(commit, is_main=self.is_main, group=group)
        except DtrainError as exc:
            raise self._failed(step, str(exc)) from None
        if self.on_store is not None and marker is not None:
            self.on_store.seal_on_node(step, marker, self.config.keep)
        self.last_saved_step = step
        return Checkpoint(step, self.store.root / f"step-{step}")

    def _failed(self, step: int, error: str) -> CheckpointError:
        """The partial checkpoint `step` removed, and the one line every rank raises."""
        if self.is_main:
            self.store.abandon(step)
            if self.on_store is not None:
                self.on_store.unseal_after_failure(step)
        elif self.on_store is not None and self.on_store.leads_node:
            self.store.abandon(step)
        newest = self.store.newest()
        kept = f"; {newest.name} is intact" if newest else ""
        return CheckpointError(
            f"could not write checkpoint step-{step} in {self.store.root}: {error}{kept}; free space or choose "
            f"another run.dir"
        )


T = TypeVar("T")


def _pass_on(done: Future[Any], written: Future[dict[str, Any]], meta: dict[str, Any]) -> None:
    """`written` ends as DCP's write `done` did: with the marker's `meta`, or its exception."""
    error = done.exception()
    if error is not None:
        written.set_exception(error)
    else:
        written.set_result(meta)


def _as_checkpoint_error(collective: Callable[[], T]) -> T:
    """`collective()`, whose agreed refusal (a DtrainError on every rank) is raised as a CheckpointError."""
    try:
        return collective()
    except CheckpointError:
        raise
    except DtrainError as exc:
        raise CheckpointError(str(exc)) from None


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
