"""What a checkpoint holds and how it goes back in.

    step-<N>/state/             model and optimizer tensors, by torch.distributed.checkpoint (DCP)
    step-<N>/trainer.json       step, epoch, world size, batch geometry, optimizer groups, LR schedule,
                                GradScaler — everything that is not a tensor, as JSON
    step-<N>/rng-rank<R>.safetensors   each rank's torch / CUDA / numpy / python RNG states

Only tensors go through DCP, whose tensor files load with `torch.load(weights_only=True)`; its
metadata file is read by a restricted unpickler that accepts DCP's own metadata classes and nothing
else. No pickle from a checkpoint is ever loaded unrestricted.
"""

from __future__ import annotations

import contextlib
import copyreg
import dataclasses
import enum
import json
import math
import os
import pickle
import random
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from dtrain.checkpoint.state import Parts, Position, identity_mismatch
from dtrain.checkpoint.store import CheckpointError, describe_failure
from dtrain.files import fsync_file, user_file_mode

TENSORS = "state"
TRAINER = "trainer.json"
_IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")


def save(folder: Path, parts: Parts, position: Position) -> dict[str, Any]:
    """Write this rank's share of a checkpoint into `folder` (every rank calls it). Returns the
    marker metadata."""
    untouched = not parts.optimizer.state  # no update applied yet (fp16 may skip the first steps)
    model_state, optim_state = get_state_dict(parts.module, parts.optimizer)
    if untouched:
        # DCP fills an empty optimizer by taking a step at lr 0 (AdamW's step count becomes 1, and
        # bias correction would differ from a run that never saved): undo that, save it empty.
        parts.optimizer.state.clear()
        optim_state["state"] = {}
    tensors, leftovers = _split_tensors(optim_state["state"])
    # DCP keys each tensor by its path in this nested dict ("model.<fqn>", "optimizer.state.<fqn>.<name>")
    # and writes each once: DDP's replicas are deduplicated, FSDP's shards written by their owners.
    with _one_process_is_intended():
        dcp.save(
            {"model": model_state, "optimizer": {"state": tensors}},
            storage_writer=FileSystemWriter(folder / TENSORS),
            no_dist=parts.world_size == 1,
        )
    _save_rng(folder / f"rng-rank{parts.rank}.safetensors", _device_of(parts.module))
    meta = {
        "step": position.step,
        "epoch": position.epoch,
        "world_size": parts.world_size,
        "samples_per_step": parts.samples_per_step,
        "identity": parts.identity,
    }
    if parts.rank == 0:
        trainer = {
            **meta,
            "unscheduled_skips": position.unscheduled_skips,
            "setup": parts.setup,
            "optimizer": {"param_groups": optim_state["param_groups"], "state": leftovers},
            "scheduler": parts.scheduler.state_dict(),
            "scaler": parts.scaler.state_dict(),
        }
        (folder / TRAINER).write_text(json.dumps(trainer, indent=1))
        fsync_file(folder / TRAINER)
    return meta


def load(folder: Path, parts: Parts) -> Position:
    """Put checkpoint `folder` back into `parts` (every rank calls it); refuses what would not fit."""
    for name in (TRAINER, f"{TENSORS}/.metadata"):
        if not (folder / name).is_file():
            raise CheckpointError(f"{folder / name} is missing; delete {folder} to resume from an earlier checkpoint")
    try:
        trainer = json.loads((folder / TRAINER).read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        trainer, problem = None, f"not JSON ({exc})"
    else:
        problem = _trainer_problem(trainer)
    if problem:
        raise CheckpointError(
            f"{folder / TRAINER} is not what dtrain writes: {problem}; delete {folder} to "
            f"resume from an earlier checkpoint"
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
    # On another number of processes rank r continues rank (r mod N)'s random streams (dropout): the
    # run goes on from the same data position, but not bitwise as at the same world size.
    rng = folder / f"rng-rank{parts.rank % trainer['world_size']}.safetensors"
    if not rng.is_file():
        raise CheckpointError(f"{rng} is missing; delete {folder} to resume from an earlier checkpoint")
    reader = SafeReader(folder / TENSORS)
    saved = reader.read_metadata().state_dict_metadata
    layout = _Layout.of(saved)

    # DCP's own view of this run's model and optimizer gives the tensors to read into, each placed and
    # sharded as this run holds it (FSDP's DTensors, on this run's mesh), whatever wrote the checkpoint:
    # DCP reads only this rank's part, resharding across world sizes and strategies.
    model_state, optim_state = get_state_dict(parts.module, parts.optimizer)
    _check_model(folder, saved, model_state, layout)
    # Only what the checkpoint holds: get_state_dict's zero-lr step gives every parameter optimizer state,
    # and one that never had a gradient (unused, frozen in the user's step) has none in the checkpoint.
    optim_tensors: dict[str, dict[str, torch.Tensor]] = {}
    for fqn, values in _split_tensors(optim_state["state"])[0].items():
        held = {name: tensor for name, tensor in values.items() if layout.optimizer_key(fqn, name) in saved}
        if held and len(held) < len(values):  # all of a parameter's state, or (never updated) none
            missing = sorted(set(values) - set(held))[0]
            raise CheckpointError(
                f"checkpoint {folder.name} holds part of the optimizer state of '{fqn}' (no "
                f"'{missing}'): damaged, or written for another optimizer; delete {folder} to "
                f"resume from an earlier checkpoint, or start a new run.dir"
            )
        if held:
            optim_tensors[fqn] = held
    saved_optimizer = any(layout.is_optimizer(key) for key in saved)  # none: saved before any update
    with _one_process_is_intended():
        try:
            dcp.load(
                layout.state(model_state, optim_tensors), storage_reader=reader, no_dist=parts.world_size == 1
            )  # in place
        except (dcp.CheckpointException, RuntimeError, KeyError, ValueError, OSError, EOFError) as exc:
            # The model's names and shapes matched: its tensor files are damaged (yet sealed to match), or
            # its optimizer state is not this run's optimizer's.
            raise CheckpointError(
                f"checkpoint {folder.name}'s tensors in {folder / TENSORS} cannot be read into "
                f"this run ({describe_failure(exc)}): damaged, or written for another optimizer; "
                f"delete {folder} to resume from an earlier checkpoint, or start a new "
                f"run.dir"
            ) from None

    groups = trainer["optimizer"]["param_groups"]
    for saved_group, live in zip(groups, parts.optimizer.param_groups):
        # How the optimizer computes is this run's choice (fused on CUDA, not on the CPU), not the
        # checkpoint's: a fused flag loaded onto the other path breaks GradScaler's hand-off.
        saved_group.update({key: live[key] for key in _IMPLEMENTATION if key in live})
    entries = {fqn: dict(values) for fqn, values in trainer["optimizer"]["state"].items()}
    for fqn, values in optim_tensors.items():
        entries.setdefault(fqn, {}).update(values)
    try:
        # Not strict: a parameter that never had a gradient has no optimizer state to set (the model's
        # keys and shapes were checked above, by _check_model).
        set_state_dict(
            parts.module,
            parts.optimizer,
            model_state_dict=model_state,
            optim_state_dict={"state": entries, "param_groups": groups},
            options=StateDictOptions(strict=False),
        )
        if not saved_optimizer:
            parts.optimizer.state.clear()  # saved before any update: undo DCP's zero-lr step here too
        parts.scheduler.load_state_dict(trainer["scheduler"])
        if trainer.get("scaler"):
            parts.scaler.load_state_dict(trainer["scaler"])
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError) as exc:
        raise CheckpointError(
            f"checkpoint {folder.name} does not fit this run's optimizer or schedule "
            f"({type(exc).__name__}: {exc}); delete {folder} to resume from an earlier checkpoint, "
            f"or start a new run.dir"
        ) from None
    _load_rng(rng, _device_of(parts.module))
    return Position(
        step=trainer["step"],
        epoch=trainer["epoch"],
        unscheduled_skips=trainer.get("unscheduled_skips", 0),
        setup=trainer.get("setup", {}),
    )


PerParameter = dict[str, dict[str, Any]]  # an optimizer's state: {parameter fqn: {name: value}}


def _split_tensors(state: PerParameter) -> tuple[PerParameter, PerParameter]:
    """An optimizer's per-parameter state split into its tensors (for DCP) and the rest (for trainer.json,
    as JSON: no pickle in a checkpoint)."""
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    rest: dict[str, dict[str, Any]] = {}
    for fqn, values in state.items():
        for name, value in values.items():
            side = tensors if isinstance(value, torch.Tensor) else rest
            side.setdefault(fqn, {})[name] = value
    return tensors, rest


class _Layout:
    """Where a checkpoint keeps its tensors: DCP's paths of the nested state ("model.<fqn>",
    "optimizer.state.<fqn>.<name>"), or dtrain 0.2's flat names ("model/<fqn>", "optimizer/<fqn>/<name>"),
    still read so that no earlier checkpoint is lost."""

    def __init__(self, flat: bool):
        self.flat = flat
        self.model_prefix = "model/" if flat else "model."

    @classmethod
    def of(cls, saved: dict[str, Any]) -> _Layout:
        return cls(flat=any(key.startswith("model/") for key in saved))

    def is_optimizer(self, key: str) -> bool:
        return key.startswith("optimizer/" if self.flat else "optimizer.state.")

    def optimizer_key(self, fqn: str, name: str) -> str:
        return f"optimizer/{fqn}/{name}" if self.flat else f"optimizer.state.{fqn}.{name}"

    def state(self, model: dict[str, Any], optim: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any]:
        """The state to hand dcp.load, keyed as this checkpoint keys it (the same tensors either way)."""
        if not self.flat:
            return {"model": model, "optimizer": {"state": optim}}
        flat = {f"model/{key}": value for key, value in model.items()}
        flat.update(
            {self.optimizer_key(fqn, name): value for fqn, values in optim.items() for name, value in values.items()}
        )
        return flat


def _trainer_problem(trainer: Any) -> str | None:
    """What is wrong with a trainer.json's shape (a file edited or damaged, and sealed again), or None."""
    if not isinstance(trainer, dict):
        return "not a JSON object"
    required = {"step": 0, "epoch": 0, "world_size": 1, "samples_per_step": 1}
    for key, least in (*required.items(), ("unscheduled_skips", 0)):
        value = trainer.get(key, None if key in required else 0)
        if not (isinstance(value, int) and not isinstance(value, bool) and least <= value < 2**53):
            return f"{key} is {value!r}, not a whole number >= {least}"
    optimizer = trainer.get("optimizer")
    if not (
        isinstance(optimizer, dict)
        and isinstance(optimizer.get("state"), dict)
        and all(isinstance(entry, dict) for entry in optimizer["state"].values())
        and isinstance(optimizer.get("param_groups"), list)
        and all(isinstance(g, dict) for g in optimizer["param_groups"])
    ):
        return "its optimizer entry is malformed"
    for key in ("scheduler", "scaler", "identity", "setup"):
        if not isinstance(trainer.get(key, {}), dict):
            return f"its {key} entry is not an object"
    for group in optimizer["param_groups"]:
        for key, value in group.items():
            if key != "params" and not (
                value is None
                or isinstance(value, bool)
                or _rate(value)
                or (isinstance(value, list) and value and all(_rate(v) for v in value))
            ):
                return (
                    f"optimizer setting {key} is {value!r}, not a finite number >= 0, true/false or a list of numbers"
                )
    scheduler = trainer.get("scheduler", {})
    for key in ("last_epoch", "_step_count"):
        value = scheduler.get(key, 0)
        if not (isinstance(value, int) and not isinstance(value, bool) and -1 <= value < 2**53):
            return f"scheduler {key} is {value!r}, not a whole number"
    for key in ("base_lrs", "_last_lr"):
        if not (isinstance(scheduler.get(key, []), list) and all(_rate(v) for v in scheduler.get(key, []))):
            return f"scheduler {key} is {scheduler.get(key)!r}, not a list of finite numbers >= 0"
    return None


def _rate(value: Any) -> bool:
    """A finite number >= 0, as every optimizer and schedule setting dtrain saves is."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


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
    saved_world, saved_per_rank = trainer["world_size"], trainer["samples_per_step"]
    if saved_world * saved_per_rank != parts.world_size * parts.samples_per_step:
        raise CheckpointError(
            f"checkpoint {folder.name} trained on global batches of "
            f"{saved_world * saved_per_rank} samples and this run takes "
            f"{parts.world_size * parts.samples_per_step}; resume with the same global batch "
            f"(processes × data.batch_size × training.grad_accum_steps), or start a new run.dir"
        )


def _check_model(folder: Path, saved: dict[str, Any], model_state: dict[str, Any], layout: _Layout) -> None:
    prefix = layout.model_prefix
    saved_model = {k[len(prefix) :]: item for k, item in saved.items() if k.startswith(prefix)}
    for key, tensor in model_state.items():
        item = saved_model.get(key)
        if item is None:
            raise CheckpointError(
                f"checkpoint {folder.name} has no '{key}' for this run's model; resume "
                f"with the model the checkpoint was trained with, or start a new run.dir"
            )
        if not isinstance(item, TensorStorageMetadata) or list(item.size) != list(tensor.shape):
            shape = list(item.size) if isinstance(item, TensorStorageMetadata) else "not a tensor"
            raise CheckpointError(
                f"checkpoint {folder.name} holds '{key}' of shape {shape} and this run's "
                f"model has {list(tensor.shape)}; resume with the model settings the "
                f"checkpoint was trained with, or start a new run.dir"
            )
    extra = sorted(set(saved_model) - set(model_state))
    if extra:
        raise CheckpointError(
            f"checkpoint {folder.name} holds '{extra[0]}', which this run's model lacks; "
            f"resume with the same model, or start a new run.dir"
        )


# --- RNG states -----------------------------------------------------------------------------------


def _device_of(module: nn.Module) -> torch.device:
    return next(module.parameters(), torch.empty(0)).device


def _save_rng(path: Path, device: torch.device) -> None:
    """This rank's RNG states; on a GPU, that of the device the rank computes on (and no other: a
    rank's draws on its own GPU are the only ones a resume must repeat)."""
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    tensors = {
        "torch": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
        "python_state": torch.tensor(py_state, dtype=torch.int64),
    }
    if device.type == "cuda":
        tensors["cuda"] = torch.cuda.get_rng_state(device)
    metadata = {
        "numpy": json.dumps([np_kind, np_pos, np_has_gauss, np_gauss]),
        "python": json.dumps([py_version, py_gauss]),
    }
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, user_file_mode())  # safetensors writes 0600
    fsync_file(path)


def _load_rng(path: Path, device: torch.device) -> None:
    from safetensors import safe_open

    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as fh:
        metadata = fh.metadata()
    torch.set_rng_state(tensors["torch"])
    np_kind, np_pos, np_has_gauss, np_gauss = json.loads(metadata["numpy"])
    np.random.set_state((np_kind, tensors["numpy_keys"].numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss))
    py_version, py_gauss = json.loads(metadata["python"])
    random.setstate((py_version, tuple(tensors["python_state"].tolist()), py_gauss))
    # Checkpoints before 0.2 kept every visible GPU's state as cuda_<i>.
    state = tensors.get("cuda", tensors.get(f"cuda_{device.index}")) if device.type == "cuda" else None
    if state is not None:
        torch.cuda.set_rng_state(state, device)


# --- reading DCP's metadata without unrestricted pickle ------------------------------------------------


def _torch_reconstructors() -> set[Any]:
    """The functions torch registers to rebuild its layouts and memory formats from a pickle (found
    through copyreg, not named: they are private and may move)."""
    found = set()
    for example in (torch.strided, torch.contiguous_format):
        reduce = copyreg.dispatch_table.get(type(example))
        if reduce is not None:
            found.add(reduce(example)[0])
    return found


_PLAIN = {("torch", "Size"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """Accepts DCP's metadata and nothing else, by rule rather than by name (DCP's classes are partly
    private and change between torch versions): dataclasses and enums that torch.distributed.checkpoint
    itself defines, torch's dtypes, layouts and memory formats, torch.Size, the functions torch registered to
    rebuild its layouts, paths and OrderedDict. Anything else — a function, a class from elsewhere — is
    refused before it is imported."""

    _rebuild = _torch_reconstructors()

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PLAIN or (
            module == "torch"
            and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))
        ):
            return super().find_class(module, name)
        if module == "torch.distributed.checkpoint" or module.startswith("torch.distributed.checkpoint."):
            found = getattr(sys.modules.get(module), name, None)  # only modules DCP has already imported
            if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
                return found
        elif module.startswith("torch."):
            found = getattr(sys.modules.get(module), name, None)
            if found is not None and found in self._rebuild:
                return found
        raise pickle.UnpicklingError(f"unexpected object {module}.{name}")


def _a(noun: str) -> str:
    return f"an {noun}" if noun[:1].lower() in "aeiou" else f"a {noun}"


class SafeReader(FileSystemReader):
    """DCP's file reader, with its metadata read by the restricted unpickler above."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as fh:
                metadata = _MetadataUnpickler(fh).load()
            if not (isinstance(metadata, Metadata) and isinstance(metadata.state_dict_metadata, dict)):
                raise ValueError(f"{_a(type(metadata).__name__)}, not DCP's Metadata")
            for where in (metadata.storage_data or {}).values():  # files of this folder, nowhere else
                name = getattr(where, "relative_path", None)
                if not (isinstance(name, str) and Path(name).name == name and name not in ("", ".", "..")):
                    raise ValueError(f"it points at {name!r}, outside {path.parent}")
        except Exception as exc:
            raise CheckpointError(
                f"{path} is not DCP metadata dtrain can trust ({exc}); delete "
                f"{path.parent.parent} to resume from an earlier checkpoint"
            ) from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
