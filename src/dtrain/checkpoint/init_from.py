"""Starting a run from weights (`model.init_from`, and the folder of `model.name = "hf:PATH"`).

    a safetensors file                     any names the model's state dict has (tied tensors stored once)
    a Hugging Face model folder            model.safetensors, or shards listed by model.safetensors.index.json
    a dtrain run.dir                       its model.safetensors, else its newest complete checkpoint
    a checkpoint folder (step-N)           its model part, from DCP

`resolve` says which, without torch: the launcher refuses a path that is none of them before any worker
starts. `load_into` puts the weights into the model in every worker, after the strategy has spread it.
Under FSDP each rank reads only its own rows of each tensor (a safetensors slice, or DCP's resharding
read of a checkpoint), so no rank ever holds the whole model's weights a second time.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtrain.errors import ConfigError

INDEX = "model.safetensors.index.json"
WEIGHTS = "model.safetensors"
SHOWN = 3  # names quoted per kind of difference: the first ones, then how many more


@dataclass(frozen=True)
class Source:
    """Where the weights are: safetensors `files`, or a dtrain `checkpoint` folder (step-N)."""

    key: str  # the config key that named it, for messages
    path: Path
    files: tuple[Path, ...] = ()
    checkpoint: Path | None = None

    def describe(self) -> str:
        if self.checkpoint is not None:
            return f"checkpoint {self.checkpoint}"
        return str(self.files[0]) if len(self.files) == 1 else f"{len(self.files)} safetensors files in {self.path}"


def resolve(key: str, value: str) -> Source:
    """What `value` (a path given to `key`) holds, or a one-line refusal saying what would work."""
    from dtrain.checkpoint.manifest import MARKER
    from dtrain.checkpoint.store import CheckpointStore

    path = Path(value).expanduser()
    works = (
        "give a .safetensors file, a Hugging Face model folder (model.safetensors or "
        f"{INDEX}), a dtrain run.dir or one of its checkpoints/step-N folders"
    )
    if not path.exists():
        raise ConfigError(f"{key} = '{value}' does not exist; {works}")
    if path.is_file():
        if not _is_safetensors(path):
            raise ConfigError(f"{key} = '{value}' is not a safetensors file; {works}")
        return Source(key, path, files=(path,))
    if (path / INDEX).is_file():
        return Source(key, path, files=_indexed_files(key, path))
    if (path / WEIGHTS).is_file():
        return resolve(key, str(path / WEIGHTS))
    if (path / "trainer.json").is_file() and (path / "state" / ".metadata").is_file():
        if not (path / MARKER).is_file():
            raise ConfigError(f"{key} = '{value}' is a checkpoint that was never completed (no {MARKER}); {works}")
        return Source(key, path, checkpoint=path)
    newest = CheckpointStore(path).newest()
    if newest is not None:  # a run.dir without final weights yet: its newest checkpoint
        return Source(key, path, checkpoint=newest.path)
    raise ConfigError(f"{key} = '{value}' is a folder with no weights dtrain can read; {works}")


def _is_safetensors(path: Path) -> bool:
    """Its header is what safetensors writes: an 8-byte length, then that many bytes of a JSON object."""
    try:
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= min(100_000_000, path.stat().st_size - 8):
                return False
            return isinstance(json.loads(f.read(size)), dict)
    except (OSError, ValueError):
        return False


def _indexed_files(key: str, folder: Path) -> tuple[Path, ...]:
    """The shards a Hugging Face index lists (`weight_map`: tensor name → file), each checked present."""
    try:
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{key}: {folder / INDEX} is not a safetensors index ({exc})") from None
    for name in names:
        if not _is_safetensors(folder / name):
            raise ConfigError(f"{key}: {folder / INDEX} lists {name}, which is missing or not safetensors")
    return tuple(folder / name for name in names)


def load_into(module: Any, source: Source, is_main: bool) -> None:
    """Read `source` into `module`'s parameters and buffers in place, on every rank (a collective). Names
    and shapes are checked first, by rank 0, and a difference is one line on every rank."""
    import torch

    from dtrain import distributed

    state = module.state_dict()
    if source.checkpoint is not None:
        stored, flat = _checkpoint_names(source.checkpoint)
        distributed.rank0_decides(lambda: _fit(source, state, stored), is_main=is_main)
        _read_checkpoint(source.checkpoint, state, flat)
        return
    from safetensors import safe_open

    with contextlib.ExitStack() as held:
        opened = [held.enter_context(safe_open(str(f), framework="pt")) for f in source.files]
        where = {name: handle for handle in opened for name in handle.keys()}  # noqa: SIM118 — not a dict
        names = distributed.rank0_decides(
            lambda: _fit(source, state, {n: tuple(h.get_slice(n).get_shape()) for n, h in where.items()}, opened),
            is_main=is_main,
        )
        assert names is not None
        with torch.no_grad():
            for name, tensor in state.items():
                _copy(where[names[name]], names[name], tensor)


def _copy(handle: Any, stored: str, tensor: Any) -> None:
    """Copy this rank's part of one stored tensor into `tensor`: all of it, or under FSDP (a DTensor)
    only the rows (or blocks) this rank holds — a slice read from the file, never the whole tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        tensor.copy_(handle.get_tensor(stored))
        return
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = tensor.to_local()
    if local.numel():  # an uneven split leaves the last ranks some tensors' empty shards
        shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        local.copy_(handle.get_slice(stored)[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))])


def _checkpoint_names(folder: Path) -> tuple[dict[str, tuple[int, ...]], bool]:
    """A checkpoint's model tensors (name → shape) from its DCP metadata, and whether it is of the flat
    format 1 ("model/<fqn>" rather than "model.<fqn>")."""
    from dtrain.checkpoint import formats
    from dtrain.checkpoint.metadata import SafeReader
    from dtrain.checkpoint.tensors import TENSORS, _read_trainer

    tensors = SafeReader(folder / TENSORS).read_metadata().state_dict_metadata
    flat = formats.of_trainer(_read_trainer(folder), tensors) == formats.FLAT_NAMES
    prefix = "model/" if flat else "model."
    stored = {
        name[len(prefix) :]: tuple(getattr(meta, "size", ()))
        for name, meta in tensors.items()
        if name.startswith(prefix)
    }
    return stored, flat


def _read_checkpoint(folder: Path, state: dict[str, Any], flat: bool) -> None:
    """DCP reads each rank's part of the model, whatever world size and strategy wrote it."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dtrain.checkpoint.metadata import SafeReader
    from dtrain.checkpoint.tensors import TENSORS, _one_process_is_intended

    target = {f"model/{key}": value for key, value in state.items()} if flat else {"model": state}
    alone = not dist.is_initialized() or dist.get_world_size() == 1
    with _one_process_is_intended():
        dcp.load(target, storage_reader=SafeReader(folder / TENSORS), no_dist=alone)


def _fit(
    source: Source, state: dict[str, Any], stored: dict[str, tuple[int, ...]], opened: Sequence[Any] = ()
) -> dict[str, str]:
    """Each state-dict name → the stored name it reads from; or a one-line refusal naming the first
    missing, unexpected and differently shaped tensors. A tensor tied under several names (GPT-2's
    lm_head and wte) may be stored under any one of them: dtrain's model.safetensors notes the others
    in its metadata (as safetensors' `save_model` does), Hugging Face's leaves them out."""
    aliases = {n: v for h in opened for n, v in (h.metadata() or {}).items() if v in stored and n not in stored}
    ties = _tie_groups(state)
    names: dict[str, str] = {}
    missing, shapes = [], []
    for name, tensor in state.items():
        found = next((n for n in (name, aliases.get(name), *ties.get(name, ())) if n in stored), None)
        if found is None:
            missing.append(name)
            continue
        names[name] = found
        if tuple(stored[found]) != tuple(tensor.shape):
            shapes.append(f"{name} {list(stored[found])} in the file, {list(tensor.shape)} in the model")
    used = set(names.values())
    unexpected = [n for n in stored if n not in used]
    problems = [
        f"{what} {_first(items)}"
        for what, items in (("missing", missing), ("unexpected", unexpected), ("shape of", shapes))
        if items
    ]
    if problems:
        raise ConfigError(
            f"{source.key} = '{source.path}' does not fit the model: {'; '.join(problems)}; give weights "
            f"saved from a model of this model.name and model.options"
        )
    return names


def _first(items: list[str]) -> str:
    more = len(items) - SHOWN
    return ", ".join(items[:SHOWN]) + (f" (and {more} more)" if more > 0 else "")


def _tie_groups(state: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    """Each name of a tensor the state dict holds under several names → its other names (state_dict()
    detaches: a tied parameter shows as two tensors over one storage)."""
    from torch.distributed.tensor import DTensor

    by_storage: dict[tuple, list[str]] = {}
    for name, tensor in state.items():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.numel():
            where = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(tensor.shape))
            by_storage.setdefault(where, []).append(name)
    return {n: tuple(o for o in group if o != n) for group in by_storage.values() if len(group) > 1 for n in group}
