"""What a batch is, whatever its shape: a tensor, a tuple or list, a dict (Hugging Face's BatchEncoding
included), a namedtuple or a dataclass, nested.

dtrain needs four things from a batch: to collate samples into it, to move it to the device, to count
its samples and tokens (from shapes alone: no host sync), and to find its target for eval metrics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, default_collate

IGNORE_INDEX = -100  # the target value cross-entropy (and every Hugging Face model) leaves out


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _rebuild_mapping(like: Mapping, items: dict) -> Mapping:
    try:
        return type(like)(items)  # type: ignore[call-arg]  # dict, OrderedDict, BatchEncoding, UserDict ...
    except Exception:
        return items


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`obj` with `fn` applied to every tensor in it, its containers rebuilt as they were."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return _rebuild_mapping(obj, {k: map_tensors(v, fn) for k, v in obj.items()})
    if _is_namedtuple(obj):
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    if _is_dataclass_instance(obj):
        return dataclasses.replace(
            obj, **{f.name: map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj) if f.init}
        )
    return obj


def tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in `obj`, in order."""
    found: list[torch.Tensor] = []
    map_tensors(obj, lambda t: found.append(t))
    return found


def to_device(obj: Any, device: torch.device) -> Any:
    """Move every tensor in `obj` to `device` without blocking (pinned host memory makes it a true copy
    engine transfer)."""
    return map_tensors(obj, lambda t: t.to(device, non_blocking=True))


def collate(samples: Sequence[Any]) -> Any:
    """`default_collate`, which also stacks dataclasses field by field (it stacks the rest: tensors,
    numbers, arrays, dicts, namedtuples, tuples, nested)."""
    first = samples[0]
    if _is_dataclass_instance(first):
        return dataclasses.replace(
            first,
            **{f.name: collate([getattr(s, f.name) for s in samples]) for f in dataclasses.fields(first) if f.init},
        )
    if isinstance(first, Mapping) and any(_is_dataclass_instance(v) for v in first.values()):
        return _rebuild_mapping(first, {k: collate([s[k] for s in samples]) for k in first})
    return default_collate(list(samples))


def num_samples(batch: Any) -> int:
    """How many samples `batch` holds: the leading size of its first tensor (a shape: no host sync)."""
    found = tensors(batch)
    if not found or found[0].dim() == 0:
        raise TypeError(f"a batch of {type(batch).__name__} holds no batched tensor to count samples by")
    return found[0].shape[0]


def split(batch: Any) -> tuple[Any, Any]:
    """(what the model takes, the target) of a batch: a dict gives itself and its 'labels'; a tuple or
    list (not a namedtuple) gives its leading items and its last; anything else gives itself, no target."""
    if isinstance(batch, Mapping):
        return batch, batch.get("labels")
    if isinstance(batch, (tuple, list)) and not _is_namedtuple(batch) and len(batch) >= 2:
        inputs = batch[0] if len(batch) == 2 else tuple(batch[:-1])
        return inputs, batch[-1]
    return batch, None


def num_tokens(target: Any) -> int | None:
    """Token positions in a batch of token sequences: its target's elements (shape only, padding included);
    None when the target is not integer sequences (class labels, regression values)."""
    if not isinstance(target, torch.Tensor) or target.dim() < 2 or target.is_floating_point():
        return None
    return target.numel()


def real_tokens(batch: Any) -> torch.Tensor:
    """The real tokens of a batch of token sequences, padding left out (on the device: no host sync): its
    `attention_mask`'s ones where it has one; every position of packed windows (inputs holding
    `position_ids` and no mask: no padding, and a document's first token is real though nothing predicts
    it); else its target's positions that are not -100."""
    inputs, target = split(batch)
    mask = inputs.get("attention_mask") if isinstance(inputs, Mapping) else None
    if isinstance(mask, torch.Tensor):
        return mask.ne(0).sum()
    if isinstance(inputs, Mapping) and isinstance(inputs.get("position_ids"), torch.Tensor):
        return torch.tensor(target.numel(), device=target.device)
    return target.ne(IGNORE_INDEX).sum()


class TensorDict(Dataset):
    """A dict of equally long tensors as a map-style data set: sample i is {key: tensor[i]}. Training
    takes whole batches from it by index (the fast path), like from a TensorDataset."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        lengths = {k: len(v) for k, v in tensors.items()}
        if not tensors or len(set(lengths.values())) != 1:
            raise ValueError(f"TensorDict needs tensors of one length; got {lengths}")
        self.tensors = dict(tensors)

    def __len__(self) -> int:
        return len(next(iter(self.tensors.values())))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {k: v[index] for k, v in self.tensors.items()}


class BatchGatherer(Dataset):
    """dtrain's own fast path, by subclassing: a data set that reads a whole batch itself with
    `take(indices)` (token windows from a memory map or object storage), with no per-sample Python and no
    collate. Marked by this class, never recognised by the method's name: other libraries' data sets have
    a `take` of their own (Hugging Face's `datasets.Dataset.take(n)` is "the first n rows"), and those go
    through the DataLoader with the user's `collate_fn` like any other map-style set."""

    read_ahead = False  # True: the batch loop asks for the next batch while this one trains

    def take(self, indices: torch.Tensor) -> Any:
        raise NotImplementedError
