"""Batches for the training step and for evaluation, grouped for gradient accumulation.

Two paths, one interface. Data held as tensors (`TensorDataset`, and every built-in set) is gathered
a whole batch at a time with `index_select` — on the GPU when there is one — with no per-sample Python
and no collate. Any other map-style data set goes through a `DataLoader` with workers, pinned memory
and prefetch. Both yield, for each optimizer step, the list of micro-batches that step consumes.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from ..config import DataConfig
from .sampler import IndexSampler, ShardSampler, eval_shard

Batch = tuple[Any, torch.Tensor]  # (inputs, targets) on the training device


def to_device(obj: Any, device: torch.device) -> Any:
    """Move a tensor, or tensors nested in tuples/lists/dicts, to `device` without blocking."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


class TrainBatches:
    """One rank's training batches: `epoch(e)` yields a list of micro-batches per optimizer step."""

    def __init__(self, dataset: Dataset, sampler: ShardSampler, data: DataConfig, grad_accum_steps: int,
                 device: torch.device):
        self.sampler = sampler
        self.batch_size = data.batch_size
        self.accum = grad_accum_steps
        self.drop_last = data.drop_last
        self.device = device
        per_rank = sampler.num_samples
        self.micro_batches_per_epoch = (per_rank // self.batch_size if self.drop_last
                                        else math.ceil(per_rank / self.batch_size))
        self.steps_per_epoch = math.ceil(self.micro_batches_per_epoch / self.accum)
        self._source = _source_for(dataset, data, device)

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[list[Batch]]:
        """Micro-batch groups of `epoch`, starting at optimizer step `start_step` of that epoch."""
        self.sampler.set_epoch(epoch)
        shard = self.sampler.shard()
        usable = self.micro_batches_per_epoch * self.batch_size
        shard = shard[: min(len(shard), usable)]
        first = start_step * self.accum * self.batch_size
        micro = self._source.batches(shard[first:], self.batch_size)
        group: list[Batch] = []
        for batch in micro:
            group.append(batch)
            if len(group) == self.accum:
                yield group
                group = []
        if group:
            yield group


class EvalBatches:
    """One rank's evaluation batches: each held-out sample on exactly one rank, none padded in."""

    def __init__(self, dataset: Dataset, rank: int, world_size: int, data: DataConfig,
                 device: torch.device):
        self.indices = eval_shard(len(dataset), rank, world_size)
        self.batch_size = data.eval_batch_size
        if _is_pair_of_tensors(dataset):
            # This rank only ever reads its own shard: only that is copied to the device.
            shard = TensorDataset(*(t[self.indices] for t in dataset.tensors))
            self.indices = torch.arange(len(self.indices))
            self._source = _TensorSource(shard, data.on_device, device)
        else:
            self._source = _LoaderSource(dataset, data, device)

    def __iter__(self) -> Iterator[Batch]:
        return self._source.batches(self.indices, self.batch_size)


def _is_pair_of_tensors(dataset: Dataset) -> bool:
    return isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2


def _source_for(dataset: Dataset, data: DataConfig, device: torch.device):
    if _is_pair_of_tensors(dataset):
        return _TensorSource(dataset, data.on_device, device)
    return _LoaderSource(dataset, data, device)


class _TensorSource:
    """Gathers batches from tensors by index, in one call per tensor.

    With `on_device` the tensors are held on the training device. For training that is the whole set:
    DistributedSampler reshuffles every epoch, so each rank draws from all of it over a run.
    """

    def __init__(self, dataset: TensorDataset, on_device: bool, device: torch.device):
        self.device = device
        self.store_device = device if on_device else torch.device("cpu")
        self.inputs, self.targets = (t.to(self.store_device) for t in dataset.tensors)

    def batches(self, indices: torch.Tensor, batch_size: int) -> Iterator[Batch]:
        if len(indices) == 0:  # split() would hand out one empty batch
            return
        indices = indices.to(self.store_device)
        for chunk in indices.split(batch_size):
            x = self.inputs.index_select(0, chunk)
            y = self.targets.index_select(0, chunk)
            if self.store_device != self.device:
                x, y = to_device(x, self.device), to_device(y, self.device)
            yield x, y


class _LoaderSource:
    """A DataLoader over a precomputed index list, with the loading knobs from the config."""

    def __init__(self, dataset: Dataset, data: DataConfig, device: torch.device):
        self.dataset = dataset
        self.device = device
        self.options: dict[str, Any] = {
            "num_workers": data.num_workers,
            "pin_memory": data.pin_memory and device.type == "cuda",
        }
        if data.num_workers > 0:
            self.options["persistent_workers"] = data.persistent_workers
            self.options["prefetch_factor"] = data.prefetch_factor
        self._loaders: dict[int, tuple[DataLoader, IndexSampler]] = {}

    def batches(self, indices: torch.Tensor, batch_size: int) -> Iterator[Batch]:
        # One loader per batch size, kept so that persistent workers survive from epoch to epoch;
        # its sampler is pointed at this call's indices.
        if batch_size not in self._loaders:
            sampler = IndexSampler(indices)
            loader = DataLoader(self.dataset, batch_size=batch_size, sampler=sampler, **self.options)
            self._loaders[batch_size] = (loader, sampler)
        loader, sampler = self._loaders[batch_size]
        sampler.indices = indices
        for batch in loader:
            x, y = batch[0], batch[1]
            yield to_device(x, self.device), to_device(y, self.device)
