"""Batches for the training step and for evaluation, grouped for gradient accumulation.

Two paths, one interface. Data held as tensors (a `TensorDataset` of any number of tensors, a
`TensorDict`, every built-in set) is gathered a whole batch at a time with `index_select` — on the GPU
when there is one — with no per-sample Python and no collate; a `BatchGatherer` (token windows) reads its
own whole batches. Any other map-style data set goes through
a `DataLoader` with workers, pinned memory, prefetch and the user's `collate_fn` (default: `collate`).
A batch may be any shape (see batch.py). Both yield, for each optimizer step, the list of micro-batches
that step consumes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any, TypeGuard

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from dtrain.config import Config, DataConfig
from dtrain.data.batch import BatchGatherer, TensorDict, collate, map_tensors, to_device
from dtrain.data.datasets import check_shardable, random_needs_tokens
from dtrain.data.random_windows import RandomWindows
from dtrain.data.sampler import IndexSampler, ShardSampler, eval_shard, train_sampler
from dtrain.data.streams import StreamBatches, is_stream
from dtrain.data.tokens import TokenWindows
from dtrain.data.workers import end_workers
from dtrain.errors import DataError

Batch = Any  # a tensor, tuple, dict, namedtuple or dataclass of tensors, on the training device
Collate = Callable[[list[Any]], Any]


class TrainBatches:
    """One rank's training batches: `epoch(e)` yields a list of micro-batches per optimizer step."""

    def __init__(
        self,
        dataset: Dataset,
        sampler: ShardSampler,
        data: DataConfig,
        grad_accum_steps: int,
        device: torch.device,
        collate_fn: Collate | None = None,
    ):
        self.sampler = sampler
        self.batch_size = data.batch_size
        self.accum = grad_accum_steps
        self.drop_last = data.drop_last
        self.device = device
        per_rank = sampler.num_samples
        self.micro_batches_per_epoch = (
            per_rank // self.batch_size if self.drop_last else math.ceil(per_rank / self.batch_size)
        )
        self.steps_per_epoch = math.ceil(self.micro_batches_per_epoch / self.accum)
        self._source = _source_for(dataset, data, device, collate_fn)

    def parts(self) -> dict[str, Any]:
        """What the checkpoint keeps of the batches: nothing, the step says the position."""
        return {}

    def close(self) -> None:
        """End the DataLoader workers kept for the next epoch (the run is over: see workers.py)."""
        if isinstance(self._source, _LoaderSource):
            self._source.close()

    def stream(self, step: int) -> Iterator[list[Batch]]:
        """Every step's micro-batches from `step` (the run's position) on, one epoch's order after the next:
        each epoch is shuffled by its number, so a resumed run sees the batches it would have."""
        for epoch in itertools.count(step // self.steps_per_epoch):
            yield from self.epoch(epoch, start_step=max(0, step - epoch * self.steps_per_epoch))

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


Batches = TrainBatches | StreamBatches | RandomWindows  # what the training loop reads


def samples_in(dataset: Any) -> int | str:
    """The training set's size as a checkpoint's identity keeps it: an iterable set's is unknown."""
    return "an iterable data set" if is_stream(dataset) else len(dataset)


def train_batches(
    dataset: Any,
    config: Config,
    rank: int,
    world_size: int,
    accum: int,
    global_order: bool,
    device: torch.device,
    collate_fn: Collate | None,
) -> Batches:
    """This rank's training batches: a map-style set's shard in the epoch's order, an iterable set's
    share (streams.py), or token windows at random offsets (data.sampling = random, random_windows.py)."""
    data = config.data
    if data.sampling == "random":
        if not isinstance(dataset, TokenWindows):
            raise DataError(random_needs_tokens(type(dataset).__name__))
        check_shardable(config, len(dataset), world_size)
        return RandomWindows(dataset, data, accum, config.run.seed, rank, world_size, device)
    if is_stream(dataset):
        return StreamBatches(dataset, data, accum, config.training.max_steps, rank, world_size, device, collate_fn)
    n = len(dataset)
    check_shardable(config, n, world_size)
    seed, shuffle = config.run.seed, data.shuffle
    sampler = train_sampler(n, rank, world_size, data.batch_size, seed, accum, global_order, shuffle)
    batches = TrainBatches(dataset, sampler, data, accum, device, collate_fn)
    if batches.steps_per_epoch == 0:  # an epoch of no steps
        raise DataError(
            f"data.drop_last=true with data.batch_size={data.batch_size} leaves no full batch of the "
            f"{sampler.num_samples} samples per process; lower data.batch_size or set data.drop_last=false"
        )
    return batches


class EvalBatches:
    """One rank's evaluation batches: each held-out sample on exactly one rank, none padded in."""

    interleaved = True  # rank r holds samples r, r + world, ... (eval_shard): gathered, they interleave

    def __init__(
        self,
        dataset: Any,  # any map-style data set with a length
        rank: int,
        world_size: int,
        data: DataConfig,
        device: torch.device,
        collate_fn: Collate | None = None,
    ):
        self.indices = eval_shard(len(dataset), rank, world_size)
        self.batch_size = data.eval_batch_size
        # Rank 0's shard is the largest: every rank can tell how many batches the busiest one runs.
        self.most_batches = math.ceil(math.ceil(len(dataset) / world_size) / self.batch_size)
        self._filler_source = lambda: _source_for(
            _rows(dataset, torch.tensor([0])) if _tensor_backed(dataset) else dataset, data, device, collate_fn
        )
        if _tensor_backed(dataset):
            # This rank only ever reads its own shard: only that is copied to the device.
            self._source = _TensorSource(_rows(dataset, self.indices), data.on_device, device)
            self.indices = torch.arange(len(self.indices))
        else:
            self._source = _source_for(dataset, data, device, collate_fn)

    def __iter__(self) -> Iterator[Batch]:
        return self._source.batches(self.indices, self.batch_size)

    def evened(self) -> Iterator[tuple[Batch, bool]]:
        """(batch, counted): this rank's batches, then as many uncounted repeats of one of them as make
        every rank run the same number of forward passes — needed where the forward pass is itself a
        collective (FSDP gathers parameters in it). A rank with no sample of its own repeats sample 0."""
        ran, filler = 0, None
        for batch in self:
            filler = batch if filler is None else filler
            ran += 1
            yield batch, True
        if ran < self.most_batches and filler is None:
            filler = next(iter(self._filler_source().batches(torch.tensor([0]), 1)))
        for _ in range(self.most_batches - ran):
            yield filler, False


def _source_for(dataset: Dataset, data: DataConfig, device: torch.device, collate_fn: Collate | None):
    if _tensor_backed(dataset):
        return _TensorSource(dataset, data.on_device, device)
    if isinstance(dataset, BatchGatherer):  # dtrain's own marker: another library's `take` means another thing
        return _TakeSource(dataset, device, pin=data.pin_memory and device.type == "cuda")
    return _LoaderSource(dataset, data, device, collate_fn)


def _tensor_backed(dataset: Any) -> TypeGuard[TensorDataset | TensorDict]:
    return isinstance(dataset, (TensorDataset, TensorDict))


def _rows(dataset: TensorDataset | TensorDict, indices: torch.Tensor) -> TensorDataset | TensorDict:
    if isinstance(dataset, TensorDict):
        return TensorDict({k: t[indices] for k, t in dataset.tensors.items()})
    return TensorDataset(*(t[indices] for t in dataset.tensors))


class _TensorSource:
    """Gathers batches from tensors by index, in one call per tensor: a tuple of them from a
    TensorDataset, a dict from a TensorDict.

    With `on_device` the tensors are held on the training device. For training that is the whole set:
    DistributedSampler reshuffles every epoch, so each rank draws from all of it over a run.
    """

    def __init__(self, dataset: TensorDataset | TensorDict, on_device: bool, device: torch.device):
        self.device = device
        self.store_device = device if on_device else torch.device("cpu")
        named = dataset.tensors if isinstance(dataset, TensorDict) else dict(enumerate(dataset.tensors))
        self.tensors = {k: t.to(self.store_device) for k, t in named.items()}
        self.as_dict = isinstance(dataset, TensorDict)

    def batches(self, indices: torch.Tensor, batch_size: int) -> Iterator[Batch]:
        if len(indices) == 0:  # split() would hand out one empty batch
            return
        indices = indices.to(self.store_device)
        for chunk in indices.split(batch_size):
            batch = {k: t.index_select(0, chunk) for k, t in self.tensors.items()}
            if self.store_device != self.device:
                batch = to_device(batch, self.device)
            yield batch if self.as_dict else tuple(batch.values())


class _TakeSource:
    """A BatchGatherer gathers a whole batch itself, `dataset.take(indices)` (token windows read from a
    memory map): no per-sample Python, no collate, nothing held in memory beyond the batch."""

    def __init__(self, dataset: BatchGatherer, device: torch.device, pin: bool):
        self.dataset = dataset
        self.device = device
        self.pin = pin

    def batches(self, indices: torch.Tensor, batch_size: int) -> Iterator[Batch]:
        chunks = indices.split(batch_size) if len(indices) else ()
        take = self.dataset.take
        for batch in _read_ahead(take, chunks) if self.dataset.read_ahead else map(take, chunks):
            if self.pin:
                batch = map_tensors(batch, torch.Tensor.pin_memory)
            yield to_device(batch, self.device)


def _read_ahead(take: Callable[[torch.Tensor], Any], chunks: Any) -> Iterator[Any]:
    """take(chunk) for each chunk, the next one read in a thread while the caller trains on this one: a
    data set on object storage waits a round trip per batch, which this hides behind the step. One batch
    ahead, never more (memory holds two), and the same batches in the same order as without it."""
    from concurrent.futures import ThreadPoolExecutor

    chunks = list(chunks)
    if not chunks:
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtrain-read-ahead") as pool:
        pending = pool.submit(take, chunks[0])
        for chunk in chunks[1:]:
            batch = pending.result()
            pending = pool.submit(take, chunk)
            yield batch
        yield pending.result()


class _LoaderSource:
    """A DataLoader over a precomputed index list, with the loading knobs from the config."""

    def __init__(self, dataset: Dataset, data: DataConfig, device: torch.device, collate_fn: Collate | None):
        self.dataset = dataset
        self.device = device
        self.options: dict[str, Any] = {
            "collate_fn": collate_fn or collate,
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
            # Its own generator: creating an iterator draws a seed from it, and drawn from the global RNG
            # that would shift dropout's numbers by one after every resume (and every eval).
            loader = DataLoader(
                self.dataset,
                batch_size=batch_size,
                sampler=sampler,
                generator=torch.Generator().manual_seed(0),
                **self.options,
            )
            self._loaders[batch_size] = (loader, sampler)
        loader, sampler = self._loaders[batch_size]
        sampler.indices = indices
        for batch in loader:
            yield to_device(batch, self.device)

    def close(self) -> None:
        """End the persistent workers; a later pass starts new ones."""
        for loader, _ in self._loaders.values():
            end_workers(getattr(loader, "_iterator", None))  # the iterator a persistent loader keeps
            loader._iterator = None  # so that the next pass makes a new one (as Lightning resets it)
