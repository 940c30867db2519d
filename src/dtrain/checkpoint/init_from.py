"""Starting a run from weights (`model.init_from`, and the folder of `model.name = "hf:PATH"`).

    a safetensors file                     any names the model's state dict has (tied tensors stored once)
    a Hugging Face model folder            model.safetensors, or shards listed by model.safetensors.index.json
    a dtrain run.dir                       its model.safetensors, else its newest complete checkpoint
    a checkpoint folder (step-N)           its model part, from DCP

A GPT-2 folder (`dtrain export`'s of the built-in GPT) also starts the built-in GPT: GPT-2's names are
read back as its own (hf_layout.gpt2_as_gpt), Conv1D weights transposed.

`resolve` says which, without torch: the launcher refuses a path that is none of them before any worker
starts (and, for a built-in model built on the meta device, weights whose names or shapes differ:
`check_fit`, from the files' headers). `load_into` puts the weights into the model in every worker, in
place, at the start of a new run (a resumed run reads its checkpoint instead).

It loads after the strategy has spread the model, not before: under FSDP a parameter is then a DTensor
holding only this rank's rows, and each rank reads just those rows from the file (or DCP reads them from
a checkpoint, resharding), so no rank ever reads or holds the whole model's weights. Loaded before
`fully_shard`, every rank would read every tensor whole. Under DDP every rank holds (and reads) it all.
Nor does a rank build the whole model first: the worker builds its parameters on the meta device
(models/empty.py) and each rank gives memory to its own shards only (parallel/deferred.py), uninitialised
until read into. So every one of the model's tensors must be in the file: one missing is refused.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtrain.errors import ConfigError
from dtrain.parallel.base import StageNames

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


def load_into(module: Any, source: Source, is_main: bool, stage: StageNames | None = None) -> None:
    """Read `source` into `module`'s parameters and buffers in place, on every rank (a collective). Names
    and shapes are checked first, by rank 0, and a difference is one line on every rank. `stage`: `module`
    is a pipeline stage's part of the model (the strategy's `stage`)."""
    import torch

    from dtrain import distributed

    state = module.state_dict()
    names = distributed.rank0_decides(lambda: check_fit(module, source, stage), is_main=is_main)
    assert names is not None
    if stage is not None:  # a pipeline stage's part: its own names, not rank 0's
        names = check_fit(module, source, stage)
    if source.checkpoint is not None:
        _read_checkpoint(source.checkpoint, state, _checkpoint_names(source.checkpoint)[1])
        return
    where = {name: file for file in map(_Safetensors, source.files) for name in file.entries}
    with torch.no_grad():
        for name, tensor in state.items():
            stored, transpose = names[name]
            where[stored].read_into(stored, tensor, transpose)


def check_fit(module: Any, source: Source, stage: StageNames | None = None) -> dict[str, tuple[str, bool]]:
    """Each of `module`'s state-dict names → the stored name it reads from and whether it is stored
    transposed, or a one-line refusal; from the files' headers (and a bias-less GPT's zero biases). The
    launcher asks it of a built-in model built on the meta device."""
    if source.checkpoint is not None:
        stored = _checkpoint_names(source.checkpoint)[0]
        return {n: (s, False) for n, s in _fit(source, module, stored, others=_others(stage)).items()}
    files = [_Safetensors(path) for path in source.files]
    shapes = {name: tuple(entry["shape"]) for file in files for name, entry in file.entries.items()}
    aliases = {n: v for file in files for n, v in file.metadata.items() if v in shapes and n not in shapes}
    renamed = _as_built_in_gpt(source, module, files, shapes)
    if renamed is not None:  # a GPT-2 folder (`dtrain export`'s) into the built-in GPT: its names, its shapes
        shapes = {ours: shapes[name][::-1] if t else shapes[name] for ours, (name, t) in renamed.items()}
    found = _fit(source, module, shapes, aliases, _others(stage))
    result = {n: renamed[s] if renamed is not None else (s, False) for n, s in found.items()}
    _check_floats(source, module, result, {name: e["dtype"] for file in files for name, e in file.entries.items()})
    return result


def _check_floats(source: Source, module: Any, names: dict[str, tuple[str, bool]], dtypes: dict[str, str]) -> None:
    """Integers (token ids, a quantized export) read into floating-point weights would be cast and trained
    from: refused. Other float precisions are converted, as from_pretrained converts them."""
    state = module.state_dict(keep_vars=True)
    for name, (stored, _) in names.items():
        dtype = dtypes.get(stored, "F32")
        if state[name].is_floating_point() and not (dtype.startswith("F") or dtype == "BF16"):
            raise ConfigError(
                f"{source.key} = '{source.path}' holds {stored} as {dtype} and the model's is floating point; "
                f"give weights saved as floats (F32, BF16, F16)"
            )


def _as_built_in_gpt(
    source: Source, module: Any, files: list[_Safetensors], shapes: dict[str, tuple[int, ...]]
) -> dict[str, tuple[str, bool]] | None:
    """When `module` is the built-in GPT and the files GPT-2's: each built-in name → (the file's name,
    transposed), without the biases a GPT of bias = false has not — accepted only when they are zeros
    (what `dtrain export` writes for it), since dropping others would change what the model computes."""
    from dtrain.checkpoint import hf_layout
    from dtrain.models.gpt import GPT

    if not isinstance(module, GPT):
        return None
    renamed = hf_layout.gpt2_as_gpt(list(shapes))
    if renamed is None:
        return None
    state = module.state_dict(keep_vars=True)
    spare = [o for o in renamed if o not in state and o.endswith(".bias") and o[: -len("bias")] + "weight" in state]
    where = {name: file for file in files for name in file.entries}
    nonzero = [o for o in spare if where[renamed[o][0]].read(renamed[o][0]).count_nonzero()]
    if nonzero:
        raise ConfigError(
            f"{source.key} = '{source.path}' has biases that are not zero ({_first(nonzero)}) and the built-in "
            f"gpt has none: set model.options.bias = true"
        )
    return {ours: stored for ours, stored in renamed.items() if ours not in spare}


_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64"}
_DTYPES |= {"I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


class _Safetensors:
    """One safetensors file, read a tensor's rows at a time with plain reads: safetensors' own
    `get_slice` reads the whole tensor to cut a slice from it, and a rank of a sharded model must read
    only its own rows. The format: an 8-byte header length, a JSON header (each tensor's dtype, shape
    and byte offsets, `__metadata__`), then the bytes."""

    def __init__(self, path: Path):
        self.path = path
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        self.start = 8 + size
        self.metadata = header.pop("__metadata__", None) or {}
        self.entries: dict[str, dict[str, Any]] = header

    def read(self, name: str) -> Any:
        """Tensor `name` whole."""
        import torch

        tensor = torch.empty(self.entries[name]["shape"], dtype=self._dtype(name))
        self.read_into(name, tensor)
        return tensor

    def _dtype(self, name: str) -> Any:
        import torch

        dtype = getattr(torch, _DTYPES.get(self.entries[name]["dtype"], ""), None)
        if dtype is None:
            raise ConfigError(
                f"{self.path}: tensor {name} is of dtype {self.entries[name]['dtype']}, which dtrain cannot read"
            )
        return dtype

    def read_into(self, name: str, tensor: Any, transpose: bool = False) -> None:
        """Copy this rank's part of tensor `name` (with `transpose`, of its transpose: a 2-D weight GPT-2's
        Conv1D keeps as [in, out]) into `tensor`: all of it, or under FSDP (a DTensor) only the rows (or
        blocks) this rank holds."""
        import torch
        from torch.distributed.tensor import DTensor

        full = tuple(self.entries[name]["shape"])
        full = full[::-1] if transpose else full  # the tensor's shape, as the model has it
        local, shape, offset = tensor, full, (0,) * len(full)
        if isinstance(tensor, DTensor):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            local = tensor.to_local()
            shape, offset = compute_local_shape_and_global_offset(full, tensor.device_mesh, tensor.placements)
        if not local.numel():  # an uneven split leaves the last ranks some tensors' empty shards
            return
        entry, dtype = self.entries[name], self._dtype(name)
        if transpose:
            local.copy_(self._columns(name, dtype, rows=(offset[1], shape[1]), columns=(offset[0], shape[0])).t())
            return
        row = math.prod(full[1:]) * dtype.itemsize  # bytes per index of the first dimension
        first, count = (offset[0], shape[0]) if full else (0, 1)
        data = bytearray(count * row)
        with self.path.open("rb") as f:
            f.seek(self.start + entry["data_offsets"][0] + first * row)
            if f.readinto(data) != len(data):
                raise ConfigError(f"{self.path} ends inside tensor {name}: the file is cut short")
        rows = (
            torch.frombuffer(data, dtype=dtype).view(count, *full[1:]) if full else torch.frombuffer(data, dtype=dtype)
        )
        inner = tuple(slice(o, o + n) for o, n in zip(offset[1:], shape[1:], strict=True))
        local.copy_(rows[(slice(None), *inner)] if full else rows.view(()))

    def _columns(self, name: str, dtype: Any, rows: tuple[int, int], columns: tuple[int, int]) -> Any:
        """The block (first, count) of `rows` × `columns` of 2-D tensor `name`: a rank's rows of a
        transposed tensor are the file's columns, read row by row, a column span of each, so that the
        rank reads its share and no more."""
        import torch

        width = self.entries[name]["shape"][1]
        data = bytearray(rows[1] * columns[1] * dtype.itemsize)
        span = columns[1] * dtype.itemsize
        with self.path.open("rb", buffering=0) as f:  # unbuffered: a buffer would read ahead past the span
            for i in range(rows[1]):
                f.seek(
                    self.start
                    + self.entries[name]["data_offsets"][0]
                    + ((rows[0] + i) * width + columns[0]) * dtype.itemsize
                )
                if f.readinto(memoryview(data)[i * span : (i + 1) * span]) != span:
                    raise ConfigError(f"{self.path} ends inside tensor {name}: the file is cut short")
        return torch.frombuffer(data, dtype=dtype).view(rows[1], columns[1])


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
    source: Source,
    module: Any,
    stored: dict[str, tuple[int, ...]],
    aliases: dict[str, str] | None = None,
    others: frozenset[str] = frozenset(),
) -> dict[str, str]:
    """Each state-dict name → the stored name it reads from; or a one-line refusal naming the first
    missing, unexpected and differently shaped tensors. A tensor tied under several names (GPT-2's
    lm_head and wte) may be stored under any one of them: dtrain's model.safetensors notes the others
    in its metadata (as safetensors' `save_model` does), Hugging Face's leaves them out."""
    aliases = aliases or {}
    state = module.state_dict(keep_vars=True)
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
    # A pipeline stage's part of the model (parallel/pipeline.py) reads its own names of the whole model's.
    unexpected = [n for n in stored if n not in used and n not in others]
    problems = [
        f"{what} {_first(items)}"
        for what, items in (("missing", missing), ("unexpected", unexpected), ("shape of", shapes))
        if items
    ]
    if problems:
        raise ConfigError(
            f"{source.key} = '{source.path}' does not fit the model: {'; '.join(problems)}; give weights "
            f"saved from a model of this model.name and model.options{_hf_hint(source)}"
        )
    return names


def _hf_hint(source: Source) -> str:
    """A Hugging Face folder (a `dtrain export` of the built-in gpt among them: GPT-2's names) is that
    model's weights, which only that model takes: the hint names the setting that builds it."""
    folder = source.files[0].parent if source.files else None
    if source.key != "model.init_from" or folder is None or not (folder / "config.json").is_file():
        return ""
    return f" — {folder} is a Hugging Face model folder: to train its model, give model.name = 'hf:{folder}'"


def _first(items: list[str]) -> str:
    more = len(items) - SHOWN
    return ", ".join(items[:SHOWN]) + (f" (and {more} more)" if more > 0 else "")


def _tie_groups(state: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    """Each name of a tensor the state dict (kept as the module's own tensors) holds under several names
    → its other names: a tied parameter is one object under two names."""
    by_object: dict[int, list[str]] = {}
    for name, tensor in state.items():
        by_object.setdefault(id(tensor), []).append(name)
    return {n: tuple(o for o in group if o != n) for group in by_object.values() if len(group) > 1 for n in group}


def _others(stage: StageNames | None) -> frozenset[str]:
    """The names a file holds beyond `module`'s own that are no surprise: the other pipeline stages'."""
    return stage.whole if stage is not None else frozenset()
