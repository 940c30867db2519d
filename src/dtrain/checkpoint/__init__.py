"""Checkpoints: scheduled and on preemption, atomic, verified, resumed exactly.

`Checkpointer` is what the trainer talks to; `store` knows the folders, `state` what goes in them,
`parts` how each named part (model, optimizer, …, and every registered one) is saved and put back,
`tensors` the writing and reading of them all, `formats` the layouts by number, `pending` the seam
between writing a checkpoint and sealing it, `background` the writing while training goes on
(`checkpoint.async`), `manifest` what seals one, `remote` and `on_store` checkpoints on an object store
(sealed there, node by node); `export` the final weights.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from dtrain import rundir
from dtrain.checkpoint.best import BestKeeper
from dtrain.checkpoint.manifest import MARKER
from dtrain.checkpoint.pending import PendingCheckpoint, completed
from dtrain.checkpoint.state import NOTHING_TO_TRAIN, Parts, Position, data_ranks_of, epoch_of, regroup
from dtrain.checkpoint.store import Checkpoint, CheckpointError, CheckpointStore, describe_failure, marker_problem
from dtrain.config import CheckpointConfig, Config
from dtrain.distributed import every_rank_raises, later_attempt, rank0_decides
from dtrain.errors import DtrainError
from dtrain.files import atomic_write_text

if TYPE_CHECKING:
    from dtrain.checkpoint.remote import RemoteCheckpointStore

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointStore",
    "Checkpointer",
    "Parts",
    "PendingCheckpoint",
    "Position",
    "evaluated_at",
    "finished",
    "resume_geometry",
    "truncate_metrics",
]


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

    def find_resume_point(self) -> Checkpoint | None:
        """The checkpoint this run continues from, per `checkpoint.resume` (all ranks agree)."""

        def choose() -> tuple[int, str] | None:
            self.store.remove_partials()
            checkpoint = self._choose()
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

    def _choose(self) -> Checkpoint | None:
        # A restarted group always continues where the failed one left off.
        return choose_resume(self.store, "auto" if later_attempt() else self.config.resume, self.config.resume_from)

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


def choose_resume(store: CheckpointStore, mode: str, resume_from: str = "") -> Checkpoint | None:
    """The checkpoint `checkpoint.resume = mode` continues from (`resume_from`: the one given, see
    given_checkpoint), or a refusal."""
    newest = store.newest()
    if resume_from:
        return given_checkpoint(resume_from, store)
    if mode == "no" and newest is not None:
        raise CheckpointError(
            f"run.dir {store.root.parent} already holds checkpoints (newest {newest.name}); continue "
            f"that run with --resume (or checkpoint.resume=auto), replace it with run.overwrite=true, or choose "
            f"another run.dir"
        )
    if mode == "yes" and newest is None:
        raise CheckpointError(nothing_to_resume(store))
    return newest if mode != "no" else None


def given_checkpoint(path: str, store: CheckpointStore | None) -> Checkpoint:
    """The checkpoint --resume-from PATH names (a step-N folder, or a run.dir: its newest), read where it is
    and checked whole. run.dir's own checkpoints (`store`; None: a fresh start, they go) continue the run
    started from it, so its newest wins once newer (a rerun, a restart); one not newer would be silently
    replaced by the run's first checkpoints, and is refused."""
    checkpoint = _given(path)
    newest = store.newest() if store is not None else None
    if newest is None:
        return checkpoint
    ours = checkpoint.path.resolve().parent == newest.path.resolve().parent
    if (newest.step == checkpoint.step) if ours else (newest.step > checkpoint.step):
        return newest
    if ours:
        raise CheckpointError(
            f"--resume-from {path} is a checkpoint of this run.dir older than its newest, {newest.name}; to go on "
            f"from it give another run.dir (these checkpoints stay as they are)"
        )
    raise CheckpointError(
        f"run.dir {newest.path.parent.parent} holds {newest.name}, not newer than --resume-from's "
        f"step-{checkpoint.step}; give an empty run.dir, or run.overwrite=true to replace its outputs"
    )


def _given(text: str) -> Checkpoint:
    """--resume-from's checkpoint: the step-N folder itself, or the newest of a run.dir (or of its
    checkpoints/ folder), its files checked against its marker."""
    path = Path(text).expanduser()
    if not path.exists():
        raise CheckpointError(f"--resume-from {text} does not exist; give a complete step-N folder or a run.dir")
    named = re.fullmatch(r"step-(\d+)", path.name)
    if named and path.name == f"step-{int(named.group(1))}" and (path / MARKER).is_file():
        checkpoint: Checkpoint | None = Checkpoint(int(named.group(1)), path)
    elif (path / "checkpoints").is_dir() or (path.name == "checkpoints" and path.is_dir()):
        checkpoint = CheckpointStore(path.parent if path.name == "checkpoints" else path).newest()
        if checkpoint is None:
            raise CheckpointError(f"--resume-from {text} holds no complete checkpoint; give a step-N folder")
    else:
        checkpoint = None
    if checkpoint is None:
        raise CheckpointError(
            f"--resume-from {text} is not a checkpoint: give a complete step-N folder (holding {MARKER}) or a run.dir"
        )
    return checkpoint


def check_intact(checkpoint: Checkpoint, store: CheckpointStore) -> dict[str, Any]:
    """The marker of the checkpoint a run resumes from, every file checked against it: run.dir's own, or
    --resume-from's, whose refusal never advises deleting it (that advice is for a run.dir's own)."""
    if checkpoint.path.parent.resolve() == store.root.resolve():
        return store.check_intact(checkpoint)
    try:
        return CheckpointStore(checkpoint.path.parent.parent).check_intact(checkpoint)
    except CheckpointError as exc:
        raise CheckpointError(
            f"--resume-from {checkpoint.path}: {str(exc).split('; ')[0]}; give another checkpoint"
        ) from None


def resume_geometry(
    config: CheckpointConfig, run_dir: Path, fresh: bool = False, verify: bool = False
) -> tuple[str, int, int] | None:
    """(name, world size, samples per process per step) of the checkpoint a run would continue from,
    read from its marker without touching anything (`verify`: every file checked against it too);
    None for a fresh start, or a marker the resume itself will judge."""
    store = CheckpointStore(run_dir)
    if fresh:  # run.dir's own checkpoints go: only --resume-from's counts
        checkpoint = given_checkpoint(config.resume_from, None) if config.resume_from else None
        if checkpoint is not None and checkpoint.path.resolve().is_relative_to(run_dir.resolve()):
            # run.overwrite would delete it before any worker reads it, and every other checkpoint with it.
            raise CheckpointError(
                f"--resume-from {config.resume_from} lies in run.dir {run_dir}, which run.overwrite=true "
                f"replaces before it is read; give another run.dir, or drop run.overwrite"
            )
    else:
        checkpoint = choose_resume(store, "auto" if later_attempt() else config.resume, config.resume_from)
    if checkpoint is None:
        return None
    if verify:
        meta = check_intact(checkpoint, store)
    else:
        try:
            meta = checkpoint.meta()
        except (OSError, ValueError):
            return None
        if marker_problem(meta, checkpoint.step):
            return None
    return checkpoint.name, data_ranks_of(meta), meta.get("samples_per_step", 0)


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
    if saved_per_rank:  # format 1's markers may not say (from 3 on they must); the workers check the checkpoint
        regroup(
            name,
            saved_world,
            saved_per_rank,
            world_size,
            config.data.batch_size,
            config.training.grad_accum_steps,
            global_order,
            config.training.global_batch_size,
        )
    return name


def finished(
    config: Config, run_dir: Path, world_size: int, n_train: int | None, global_order: bool | None
) -> str | None:
    """The launcher's line for a rerun with nothing left to train, or None. The checkpoint it would
    continue is the end of a run that planned what this config plans (training.epochs and max_steps over
    as many training samples of the same data; for data in an order of the world size, as many
    processes), that run's weights were written, and the rerun trains what it did (its config.toml: the same
    model, optimizer, schedule, seed and data): whatever else the rerun changed (data.batch_size, the
    accumulation, the strategy), it would only resume and stop. A marker without its plan (written
    before checkpoints kept one), or anything else unsure, is None: the usual checks judge the rerun. A
    finished run's damaged checkpoint is refused in one line, as a resume from it would be."""
    if config.run.overwrite and not later_attempt():  # a fresh start
        return None
    store = CheckpointStore(run_dir)
    mode = "auto" if later_attempt() else config.checkpoint.resume
    checkpoint, meta = None, rundir.weights_end(run_dir)
    if config.checkpoint.resume_from or mode == "no" or store.newest() is not None or meta is None:
        checkpoint = choose_resume(store, mode, config.checkpoint.resume_from)
        if checkpoint is None or not (run_dir / "model.safetensors").is_file():
            return None
        try:
            meta = checkpoint.meta()
        except (OSError, ValueError):
            return None
        if marker_problem(meta, checkpoint.step):  # also: not an object
            return None
    # else the run ended without a checkpoint (checkpoint.at_end = false): its final weights say how
    step = checkpoint.step if checkpoint is not None else meta["step"]
    plan, identity = meta.get("plan"), meta.get("identity")
    if not isinstance(plan, dict) or not isinstance(identity, dict):
        return None
    per_epoch = plan.get("steps_per_epoch")
    same_plan = [plan.get(key) for key in ("steps", "training.epochs", "training.max_steps")] == [
        step,
        config.training.epochs,
        config.training.max_steps,
    ]
    same_data = [identity.get("data.name"), identity.get("training samples")] == [config.data.name, n_train]
    # Planned in epochs, the run trained every epoch whatever the number of processes asked now; a number of
    # steps means other samples on another number of processes, unless the data's order does not depend on it.
    same_order = data_ranks_of(meta) == world_size or global_order is True or config.training.max_steps == 0
    if not (same_plan and same_data and same_order and n_train and isinstance(per_epoch, int) and per_epoch > 0):
        return None
    if _what_changed(config, run_dir):
        return None
    if checkpoint is not None:
        store.check_intact(checkpoint)  # a damaged checkpoint is named, as when the run would resume from it
    epochs = epoch_of(step, per_epoch)
    said = f"run.dir {run_dir} is already complete (step {step} of {step}, epoch {epochs} of {epochs}); "
    return said + (NOTHING_TO_TRAIN if checkpoint is not None else f"nothing to train, and it {_no_end(run_dir)}")


def _no_end(run_dir: Path) -> str:
    """What a finished run without a checkpoint to go on from (checkpoint.at_end = false) can still do."""
    return (
        f"kept no checkpoint to train on from ({rundir.why_no_checkpoint(run_dir)}): to train on, start a new run.dir "
        f"from its weights (model.init_from={run_dir} run.dir=<a new folder>)"
    )


def nothing_to_resume(store: CheckpointStore) -> str:
    """Why --resume has no checkpoint of run.dir's own to continue from, and what would work."""
    run_dir = store.root.parent
    ended = rundir.weights_end(run_dir)
    if ended is not None or (run_dir / "model.safetensors").is_file():
        at = f" at step {ended['step']}" if ended is not None else ""
        return (
            f"--resume: run.dir {run_dir} finished{at} and {_no_end(run_dir)}, or set run.overwrite=true to start again"
        )
    if not rundir.holds_outputs(run_dir):
        return f"--resume: run.dir {run_dir} holds no run yet; start it without --resume"
    return (
        f"--resume: {store.root} holds no complete checkpoint to continue from (the run stopped before its "
        f"first); start afresh with run.overwrite=true instead of --resume"
    )


# What a run trains, as against how (batch sizes and accumulation, the strategy, precision, compile,
# loading, logging, checkpoints): a finished run rerun with another of these is judged by the usual checks.
_WHAT = {
    "run": ("seed",),
    "model": None,  # every key
    "optimizer": None,
    "scheduler": None,
    "training": ("epochs", "max_steps", "max_grad_norm"),
    "data": ("name", "path", "block_size", "eval_fraction", "drop_last", "num_samples", "input_shape", "num_classes"),
}


def _what_changed(config: Config, run_dir: Path) -> bool:
    """Whether this config trains something else than the run whose config.toml run.dir holds (also:
    there is none to compare with, or it cannot be read)."""
    from dtrain.config import tomllib

    try:
        before = tomllib.loads((run_dir / "config.toml").read_text())
    except (OSError, ValueError):
        return True
    now = config.to_dict()
    for section, keys in _WHAT.items():
        was = before.get(section)
        if not isinstance(was, dict):
            return True
        if any(was.get(key) != now[section][key] for key in keys or now[section]):
            return True
    return False


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


def evaluated_at(path: Path, step: int) -> bool:
    """Whether the metrics file at `path` holds an evaluation's record of `step`."""
    return any(record.get("step") == step and "eval_loss" in record for record in _records(path))


def _records(path: Path) -> list[dict[str, Any]]:
    """The JSON records of a metrics file (a line cut short by an interruption left out)."""
    records = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def truncate_metrics(path: Path, step: int, drop_eval_at_step: bool) -> bool:
    """Drop what an interrupted run logged after the checkpoint it resumes from (and its eval at that
    step when the resumed run evaluates it again), so the file reads as one run. Whether it dropped any
    record (the trackers, which cannot, then start new runs: observe/trackers.py)."""
    if not path.is_file():
        return False
    kept, dropped = [], False
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by the interruption (logged nowhere else: monitor.py writes here first)
        at = record.get("step", 0)
        if at < step or (at == step and not ("eval_loss" in record and drop_eval_at_step)):
            kept.append(line)
        else:
            dropped = True
    atomic_write_text(path, "".join(f"{line}\n" for line in kept))
    return dropped
