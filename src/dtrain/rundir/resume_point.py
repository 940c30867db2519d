"""Which checkpoint a run continues from — run.dir's newest, --resume-from's, or none, as `checkpoint.resume`
says — and what the launcher can tell of it before any worker starts: a resume that cannot happen, and a
rerun of a finished run (`finished`: nothing to train, said in one line)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dtrain import rundir
from dtrain.checkpoint.manifest import MARKER
from dtrain.checkpoint.state import NOTHING_TO_TRAIN, data_ranks_of, epoch_of, regroup
from dtrain.checkpoint.store import (
    Checkpoint,
    CheckpointError,
    CheckpointStore,
    check_intact,
    marker_problem,
)
from dtrain.config import CheckpointConfig, Config
from dtrain.distributed import later_attempt

if TYPE_CHECKING:
    pass


def chooser(config: CheckpointConfig) -> Callable[[CheckpointStore], Checkpoint | None]:
    """How a run's Checkpointer picks the checkpoint it continues from (`find_resume_point`)."""
    # A restarted group always continues where the failed one left off.
    return lambda store: choose_resume(store, "auto" if later_attempt() else config.resume, config.resume_from)


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
