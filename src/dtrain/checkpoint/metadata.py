"""Reading DCP's metadata file without unrestricted pickle: a restricted unpickler that accepts DCP's own
metadata classes and nothing else, and the file reader built on it."""

from __future__ import annotations

import copyreg
import dataclasses
import enum
import pickle
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from dtrain.checkpoint.store import CheckpointError


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
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata
