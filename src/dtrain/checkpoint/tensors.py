"""What a checkpoint holds and how it goes back in.

    step-<N>/state/             every part's tensors (model, optimizer, registered ones), by
                                torch.distributed.checkpoint (DCP), under the part's name
    step-<N>/trainer.json       the format, step, epoch, world size and batch geometry, then each part's
                                values that are not tensors (optimizer groups, LR schedule, GradScaler, …), as JSON
    step-<N>/rng-rank<R>.safetensors   each rank's torch / CUDA / numpy / python RNG states

Only tensors go through DCP, whose tensor files load with `torch.load(weights_only=True)`; its
metadata file is read by a restricted unpickler (checkpoint/metadata.py) that accepts DCP's own
metadata classes and nothing else. No pickle from a checkpoint is ever loaded unrestricted. What each
part saves and reads is its adapter's (checkpoint/parts.py); the formats, checkpoint/formats.py.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dtrain.checkpoint import formats
from dtrain.checkpoint.metadata import SafeReader
from dtrain.checkpoint.part import Part, Saved
from dtrain.checkpoint.parts import adapters
from dtrain.checkpoint.rng import load_rng as _load_rng
from dtrain.checkpoint.rng import save_rng as _save_rng
from dtrain.checkpoint.state import BUILT_IN_PARTS, Parts, Position, data_ranks_of, identity_mismatch
from dtrain.checkpoint.store import CheckpointError, describe_failure
from dtrain.files import fsync_file

__all__ = [
    "TENSORS",
    "SafeReader",
    "Staged",
    "_load_rng",
    "_save_rng",
    "load",
    "model_tensor_specs",
    "read_model_weights",
    "stage",
    "write",
    "write_files",
]

TENSORS = "state"
TRAINER = "trainer.json"


@dataclass
class Staged:
    """A checkpoint's content, taken from the live objects and not yet written (an asynchronous write
    would copy `tensors` off the device here, before training changes them)."""

    meta: dict[str, Any]  # the header, also the marker's
    trainer: dict[str, Any]  # trainer.json: the header and every part's JSON
    tensors: dict[str, Any]  # DCP's state: each part's tensors under its name
    parts: dict[str, Part]


def stage(parts: Parts, position: Position) -> Staged:
    """Take this rank's share of checkpoint `position` from `parts` (every rank calls it); a part value
    that is neither a tensor nor JSON is refused here, before anything is written."""
    meta = {
        "format": formats.CURRENT,
        "step": position.step,
        "epoch": position.epoch,
        "world_size": parts.world_size,
        "data_ranks": parts.data_world,
        "samples_per_step": parts.samples_per_step,
        "identity": parts.identity,
        **({"plan": parts.plan} if parts.plan else {}),
    }
    trainer = {**meta, "unscheduled_skips": position.unscheduled_skips, "setup": parts.setup}
    named = adapters(parts)
    trainer["parts"] = list(named)
    tensors: dict[str, Any] = {}
    for name, part in named.items():
        part_tensors, part_json = part.capture()
        if part_tensors:
            tensors[name] = part_tensors
        if part_json is not None:
            trainer[name] = part_json
    return Staged(meta, trainer, tensors, named)


def write(folder: Path, staged: Staged, parts: Parts) -> dict[str, Any]:
    """Write this rank's share of `staged` into `folder` (every rank calls it). Returns the marker's
    metadata."""
    # DCP keys each tensor by its path in this nested dict ("model.<fqn>", "optimizer.state.<fqn>.<name>",
    # "<part>.<key>") and writes each once: DDP's replicas are deduplicated, FSDP's shards written by their owners.
    with _one_process_is_intended():
        dcp.save(staged.tensors, storage_writer=FileSystemWriter(folder / TENSORS), no_dist=parts.world_size == 1)
    return write_files(folder, staged, parts)


def write_files(folder: Path, staged: Staged, parts: Parts) -> dict[str, Any]:
    """Write this rank's files beside DCP's: each part's own (the RNG states, taken now from the live
    generators) and, on rank 0, trainer.json. Returns the marker's metadata."""
    for part in staged.parts.values():
        part.write_files(folder)
    if parts.rank == 0:
        (folder / TRAINER).write_text(json.dumps(staged.trainer, indent=1))
        fsync_file(folder / TRAINER)
    return staged.meta


def load(folder: Path, parts: Parts) -> Position:
    """Put checkpoint `folder` back into `parts` (every rank calls it); refuses what would not fit."""
    for name in (TRAINER, f"{TENSORS}/.metadata"):
        if not (folder / name).is_file():
            raise CheckpointError(f"{folder / name} is missing; delete {folder} to resume from an earlier checkpoint")
    trainer = _read_trainer(folder)
    named = adapters(parts)
    problem = _trainer_problem(trainer, named)
    if problem:
        raise CheckpointError(
            f"{folder / TRAINER} is not what dtrain writes: {problem}; delete {folder} to "
            f"resume from an earlier checkpoint"
        )
    marked = _marker_format(folder)
    if marked is not None and trainer.get("format") != marked:
        raise CheckpointError(
            f"{folder / TRAINER} states format {trainer.get('format', 'none')} and its marker format {marked}: "
            f"one of them was edited; delete {folder} to resume from an earlier checkpoint"
        )
    if folder.name != f"step-{trainer['step']}":
        raise CheckpointError(
            f"{folder / TRAINER} says step {trainer['step']} and its folder is {folder.name}: it "
            f"was edited or copied from another checkpoint; delete {folder} to resume from an "
            f"earlier checkpoint"
        )
    problem = identity_mismatch(folder.name, trainer.get("identity") or {}, parts.identity)
    if problem:
        raise CheckpointError(problem)
    _check_geometry(folder, trainer, parts)
    tensors = SafeReader(folder / TENSORS).read_metadata().state_dict_metadata
    saved = Saved(folder, trainer, tensors, formats.of_trainer(trainer, tensors))
    held = _held(trainer)
    reading = {name: part for name, part in named.items() if name in held}
    # Each part's tensors to read into, placed and sharded as this run holds them (FSDP's DTensors, on this
    # run's mesh), whatever wrote the checkpoint: DCP reads only this rank's part, resharding across world
    # sizes and strategies.
    targets = {name: part.targets(saved) for name, part in reading.items()}
    _read_tensors(saved, targets, parts)
    for name, part in reading.items():
        try:
            part.restore(saved, targets[name])
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(part.unfit(saved, exc)) from None
    return Position(
        step=trainer["step"],
        epoch=trainer["epoch"],
        unscheduled_skips=trainer.get("unscheduled_skips", 0),
        setup=trainer.get("setup", {}),
        notes=_notes(folder.name, held, named),
    )


def read_model_weights(folder: Path, state: dict[str, Any]) -> None:
    """Read checkpoint `folder`'s model tensors into `state` (a model's state dict on the CPU, filled in
    place) in this one process, with no process group, whatever world size and strategy wrote it: what
    `dtrain generate` samples a run from before it has written its final weights."""
    trainer = _read_trainer(folder)
    reader = SafeReader(folder / TENSORS)
    flat = formats.of_trainer(trainer, reader.read_metadata().state_dict_metadata) == formats.FLAT_NAMES
    target = {f"model/{key}": value for key, value in state.items()} if flat else {"model": state}
    with _one_process_is_intended():
        dcp.load(target, storage_reader=reader, no_dist=True)


def model_tensor_specs(folder: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Checkpoint `folder`'s model tensors, name by name (the model's own names), with their full shape
    and type: read from DCP's metadata alone, so that `read_model_weights` can then read them a few at
    a time (`dtrain export` never holds the whole model)."""
    trainer = _read_trainer(folder)
    metadata = SafeReader(folder / TENSORS).read_metadata().state_dict_metadata
    prefix = "model/" if formats.of_trainer(trainer, metadata) == formats.FLAT_NAMES else "model."
    return {
        key[len(prefix) :]: (meta.size, meta.properties.dtype)
        for key, meta in metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }


def _read_trainer(folder: Path) -> dict[str, Any]:
    try:
        trainer = json.loads((folder / TRAINER).read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"{folder / TRAINER} is not what dtrain writes: not JSON ({exc}); delete {folder} to "
            f"resume from an earlier checkpoint"
        ) from None
    if isinstance(trainer, dict) and formats.newer(trainer.get("format")):
        raise CheckpointError(formats.newer_refusal(folder.name, trainer["format"]))
    return trainer


def _read_tensors(saved: Saved, targets: dict[str, Any], parts: Parts) -> None:
    if saved.flat:  # format 1 named its tensors itself, flat
        state: dict[str, Any] = {f"model/{key}": value for key, value in targets["model"].items()}
        for fqn, values in targets["optimizer"]["state"].items():
            state.update({f"optimizer/{fqn}/{name}": value for name, value in values.items()})
    else:
        state = {name: tensors for name, tensors in targets.items() if tensors}
    with _one_process_is_intended():
        try:
            dcp.load(state, storage_reader=SafeReader(saved.folder / TENSORS), no_dist=parts.world_size == 1)
        except (dcp.CheckpointException, RuntimeError, KeyError, ValueError, OSError, EOFError) as exc:
            # The names and shapes matched: its tensor files are damaged (yet sealed to match), or its
            # optimizer state is not this run's optimizer's.
            raise CheckpointError(
                f"checkpoint {saved.name}'s tensors in {saved.folder / TENSORS} cannot be read into "
                f"this run ({describe_failure(exc)}): damaged, or written for another optimizer; "
                f"delete {saved.folder} to resume from an earlier checkpoint, or start a new "
                f"run.dir"
            ) from None


def _notes(name: str, held: list[str], named: dict[str, Part]) -> list[str]:
    """One line for each part registered here that the checkpoint lacks, and one for those it holds that
    nobody registered."""
    notes = [
        f"checkpoint {name} holds no part '{part}' (registered for checkpointing here): it keeps the state "
        f"it has now, not a resumed one"
        for part in named
        if part not in held
    ]
    unread = [part for part in held if part not in named]
    if unread:
        notes.append(
            f"checkpoint {name} holds part{'s' if len(unread) > 1 else ''} {', '.join(map(repr, unread))} that "
            f"this run did not register (Trainer.register_for_checkpointing): left unread"
        )
    return notes


def _trainer_problem(trainer: Any, named: dict[str, Part]) -> str | None:
    """What is wrong with a trainer.json's shape (a file edited or damaged, and sealed again), or None:
    its header, then the entry of each part it holds that this run reads."""
    problem = _header_problem(trainer)
    if problem:
        return problem
    for name in _held(trainer):
        if name in named:
            # Formats 1 and 2 may lack a schedule or scaler entry: each is judged when it is loaded.
            problem = named[name].problem(trainer.get(name, None if "format" in trainer else {}))
            if problem:
                return problem
    return None


def _header_problem(trainer: Any) -> str | None:
    if not isinstance(trainer, dict):
        return "not a JSON object"
    stated = "format" in trainer  # formats 1 and 2 carry no number, and may lack fp16's skipped steps
    if stated and formats.stated_problem(trainer["format"]):
        return formats.stated_problem(trainer["format"])
    for key, least in (("step", 0), ("epoch", 0), ("world_size", 1), ("samples_per_step", 1), ("unscheduled_skips", 0)):
        value = trainer.get(key, 0 if key == "unscheduled_skips" and not stated else None)
        if not (isinstance(value, int) and not isinstance(value, bool) and least <= value < 2**53):
            return f"{key} is {value!r}, not a whole number >= {least}"
    for key in ("identity", "setup"):
        if not isinstance(trainer.get(key, {}), dict):
            return f"its {key} entry is not an object"
    if stated:
        names = trainer.get("parts")
        if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            return f"its parts entry is {names!r}, not a list of names"
        lacking = [name for name in BUILT_IN_PARTS if name not in names]
        if lacking:
            return f"it names no {lacking[0]} part"
    return None


def _marker_format(folder: Path) -> Any:
    """The format COMPLETE.json states (None for the formats that state none). The store has read and
    checked the marker before any resume gets here."""
    from dtrain.checkpoint.manifest import MARKER

    try:
        meta = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return meta.get("format") if isinstance(meta, dict) else None


def _held(trainer: dict[str, Any]) -> list[str]:
    """The parts a checkpoint holds: those its trainer.json names (format 3 on), the built-in ones before."""
    return list(trainer["parts"]) if "format" in trainer else list(BUILT_IN_PARTS)


@contextlib.contextmanager
def _one_process_is_intended():
    """DCP warns that it "assumes" a single process when no group exists: for a one-process run that
    is exactly right, and the warning would be the only noise on its console."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _check_geometry(folder: Path, trainer: dict[str, Any], parts: Parts) -> None:
    """The same global batch per step (the trainer has already chosen the accumulation that makes it up,
    `regroup`, or refused)."""
    saved_world, saved_per_rank = data_ranks_of(trainer), trainer["samples_per_step"]
    if saved_world * saved_per_rank != parts.data_world * parts.samples_per_step:
        raise CheckpointError(
            f"checkpoint {folder.name} trained on global batches of "
            f"{saved_world * saved_per_rank} samples and this run takes "
            f"{parts.data_world * parts.samples_per_step}; resume with the same global batch "
            f"(processes × data.batch_size × training.grad_accum_steps), or start a new run.dir"
        )
