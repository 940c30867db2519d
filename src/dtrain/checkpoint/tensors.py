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
import json
import os
import pickle
import random
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
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor

from .files import fsync_file, user_file_mode
from .state import Parts, Position, identity_mismatch, regroup
from .store import CheckpointError

TENSORS = "state"
TRAINER = "trainer.json"
_IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")


def save(folder: Path, parts: Parts, position: Position) -> dict[str, Any]:
    """Write this rank's share of a checkpoint into `folder` (every rank calls it). Returns the
    marker metadata."""
    model_state = parts.module.state_dict()
    untouched = not parts.optimizer.state  # no update applied yet (fp16 may skip the first steps)
    optim_state = get_optimizer_state_dict(parts.module, parts.optimizer)
    if untouched:
        # DCP fills an empty optimizer by taking a step at lr 0 (AdamW's step count becomes 1, and
        # bias correction would differ from a run that never saved): undo that, save it empty.
        parts.optimizer.state.clear()
        optim_state["state"] = {}
    tensors = {f"model/{k}": v.detach() for k, v in model_state.items()}
    leftovers: dict[str, dict[str, Any]] = {}
    for fqn, entries in optim_state["state"].items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer/{fqn}/{name}"] = value
            else:
                leftovers.setdefault(fqn, {})[name] = value
    # Each tensor exists on every rank (DDP keeps replicas): DCP writes each one once.
    with _one_process_is_intended():
        dcp.save({k: v.cpu() for k, v in tensors.items()}, storage_writer=FileSystemWriter(folder / TENSORS),
                 no_dist=parts.world_size == 1)
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
            raise CheckpointError(f"{folder / name} is missing; delete {folder} to resume from an earlier "
                                  f"checkpoint")
    try:
        trainer = json.loads((folder / TRAINER).read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        trainer, problem = None, f"not JSON ({exc})"
    else:
        problem = _trainer_problem(trainer)
    if problem:
        raise CheckpointError(f"{folder / TRAINER} is not what dtrain writes: {problem}; delete {folder} to "
                              f"resume from an earlier checkpoint")
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
    metadata = reader.read_metadata()
    _check_model(folder, metadata, parts.module)

    model_state = parts.module.state_dict()
    tensors: dict[str, torch.Tensor] = {f"model/{k}": v for k, v in model_state.items()}
    optim_entries: dict[str, dict[str, Any]] = {
        fqn: dict(entries) for fqn, entries in trainer["optimizer"]["state"].items()}
    params = dict(parts.module.named_parameters())
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith("optimizer/"):
            _, rest = key.split("/", 1)
            fqn, name = rest.rsplit("/", 1)
            param = params.get(fqn)
            if isinstance(param, DTensor) and list(param.shape) == list(item.size):
                # Shaped like its parameter (Adam's moments): sharded like it too under FSDP (a DTensor
                # of the same layout), so DCP reads only this rank's part, from however it was saved.
                placeholder = torch.empty_like(param.detach(), dtype=item.properties.dtype)
            else:
                placeholder = torch.empty(item.size, dtype=item.properties.dtype)
            tensors[key] = placeholder
            optim_entries.setdefault(fqn, {})[name] = placeholder
    with _one_process_is_intended():
        dcp.load(tensors, storage_reader=reader, no_dist=parts.world_size == 1)  # in place

    # The tensors stay on the CPU as read: Optimizer.load_state_dict moves each to where the optimizer
    # keeps it — moments beside their parameter, AdamW's `step` on the CPU (unless fused/capturable),
    # where reading it costs no device sync.
    groups = trainer["optimizer"]["param_groups"]
    for saved, live in zip(groups, parts.optimizer.param_groups):
        # How the optimizer computes is this run's choice (fused on CUDA, not on the CPU), not the
        # checkpoint's: a fused flag loaded onto the other path breaks GradScaler's hand-off.
        saved.update({key: live[key] for key in _IMPLEMENTATION if key in live})
    optim_state = {"state": optim_entries, "param_groups": groups}
    try:
        set_optimizer_state_dict(parts.module, parts.optimizer, optim_state)
        if not optim_entries:
            parts.optimizer.state.clear()  # saved before any update: undo DCP's zero-lr step here too
        parts.scheduler.load_state_dict(trainer["scheduler"])
        if trainer.get("scaler"):
            parts.scaler.load_state_dict(trainer["scaler"])
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise CheckpointError(f"{folder / TRAINER} does not fit this run's optimizer or schedule ({type(exc).__name__}: "
                              f"{exc}); delete {folder} to resume from an earlier checkpoint, or start a new "
                              f"run.dir") from None
    _load_rng(rng, _device_of(parts.module))
    return Position(step=trainer["step"], epoch=trainer["epoch"],
                    unscheduled_skips=trainer.get("unscheduled_skips", 0), setup=trainer.get("setup", {}))


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
    if not (isinstance(optimizer, dict) and isinstance(optimizer.get("state"), dict)
            and all(isinstance(entry, dict) for entry in optimizer["state"].values())
            and isinstance(optimizer.get("param_groups"), list)
            and all(isinstance(g, dict) for g in optimizer["param_groups"])):
        return "its optimizer entry is malformed"
    for key in ("scheduler", "scaler", "identity", "setup"):
        if not isinstance(trainer.get(key, {}), dict):
            return f"its {key} entry is not an object"
    return None


@contextlib.contextmanager
def _one_process_is_intended():
    """DCP warns that it "assumes" a single process when no group exists: for a one-process run that
    is exactly right, and the warning would be the only noise on its console."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _check_geometry(folder: Path, trainer: dict[str, Any], parts: Parts) -> None:
    """The same global batch per step. At another world size the trainer has already chosen the
    accumulation that makes it up (`regroup`), or refused."""
    saved_world, saved_per_rank = trainer["world_size"], trainer["samples_per_step"]
    if saved_world == parts.world_size:
        regroup(folder.name, saved_world, saved_per_rank, parts.world_size, parts.samples_per_step, 1, None)
    elif saved_world * saved_per_rank != parts.world_size * parts.samples_per_step:
        raise CheckpointError(f"checkpoint {folder.name} trained on global batches of "
                              f"{saved_world * saved_per_rank} samples and this run takes "
                              f"{parts.world_size * parts.samples_per_step}; resume with the same global batch "
                              f"(processes × data.batch_size × training.grad_accum_steps), or start a new run.dir")


def _check_model(folder: Path, metadata: Metadata, module: nn.Module) -> None:
    saved = {k[len("model/"):]: item for k, item in metadata.state_dict_metadata.items()
             if k.startswith("model/")}
    current = module.state_dict()
    for key, tensor in current.items():
        item = saved.get(key)
        if item is None:
            raise CheckpointError(f"checkpoint {folder.name} has no '{key}' for this run's model; resume "
                                  f"with the model the checkpoint was trained with, or start a new run.dir")
        if not isinstance(item, TensorStorageMetadata) or list(item.size) != list(tensor.shape):
            shape = list(item.size) if isinstance(item, TensorStorageMetadata) else "not a tensor"
            raise CheckpointError(f"checkpoint {folder.name} holds '{key}' of shape {shape} and this run's "
                                  f"model has {list(tensor.shape)}; resume with the model settings the "
                                  f"checkpoint was trained with, or start a new run.dir")
    extra = sorted(set(saved) - set(current))
    if extra:
        raise CheckpointError(f"checkpoint {folder.name} holds '{extra[0]}', which this run's model lacks; "
                              f"resume with the same model, or start a new run.dir")


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
    metadata = {"numpy": json.dumps([np_kind, np_pos, np_has_gauss, np_gauss]),
                "python": json.dumps([py_version, py_gauss])}
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
    np.random.set_state((np_kind, tensors["numpy_keys"].numpy().astype(np.uint32), np_pos, np_has_gauss,
                         np_gauss))
    py_version, py_gauss = json.loads(metadata["python"])
    random.setstate((py_version, tuple(tensors["python_state"].tolist()), py_gauss))
    # Checkpoints before 0.2 kept every visible GPU's state as cuda_<i>.
    state = tensors.get("cuda", tensors.get(f"cuda_{device.index}")) if device.type == "cuda" else None
    if state is not None:
        torch.cuda.set_rng_state(state, device)


# --- reading DCP's metadata without unrestricted pickle ------------------------------------------------

_DCP = "torch.distributed.checkpoint"
_ALLOWED = {
    (f"{_DCP}.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"unexpected object {module}.{name}")


class SafeReader(FileSystemReader):
    """DCP's file reader, with its metadata read by the restricted unpickler above."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as fh:
                metadata = _MetadataUnpickler(fh).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
            raise CheckpointError(f"{path} is not DCP metadata dtrain can trust ({exc}); delete "
                                  f"{path.parent.parent} to resume from an earlier checkpoint") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
