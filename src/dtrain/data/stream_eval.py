"""Evaluation over an iterable eval set (a torch or Hugging Face `IterableDataset`): each evaluation reads
the rank's share whole, from its beginning.

The share is training's (streams.rank_share): a Hugging Face set split by `split_dataset_by_node` (whole
shards where they divide among the processes, else every world-th example), any other set every
world-th sample. Every sample is therefore evaluated on exactly one rank; how many each rank holds is
whatever the split gives (a set of 5 shards on 2 processes: 3 and 2 shards' worth), and the metrics are
sums over samples, so uneven shares change nothing. `training.eval_batches` caps the samples in all at
eval_batches × data.eval_batch_size: rank r evaluates the first cap/world (one more for the first
cap mod world ranks) of its share, in its order, so every evaluation reads the same samples (a set that
shuffles by epoch is not told one here). A rank whose share is shorter than its part evaluates what it has.

The share is read in the evaluating process (no DataLoader workers): the batch counts are not known in
advance, so where the forward pass is a collective (FSDP), the ranks agree before each batch whether any
still has one (`evened`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dtrain import distributed
from dtrain.config import DataConfig
from dtrain.data.batch import collate, to_device
from dtrain.data.streams import rank_share


class StreamEvalBatches:
    """One rank's evaluation batches of an iterable eval set: its share, whole or capped (module docstring)."""

    interleaved = False  # ranks hold their shares' samples, not samples r, r + world, ... of a known order

    def __init__(
        self,
        dataset: Any,
        rank: int,
        world_size: int,
        data: DataConfig,
        device: torch.device,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        eval_batches: int = 0,
    ):
        self.dataset, self.device = dataset, device
        self.source = rank_share(dataset, rank, world_size)
        self.batch_size, self.collate_fn = data.eval_batch_size, collate_fn or collate
        cap = eval_batches * data.eval_batch_size
        self.quota = cap // world_size + int(rank < cap % world_size) if cap else None

    def __iter__(self) -> Iterator[Any]:
        samples = iter(self.source)
        if self.quota is not None:
            samples = itertools.islice(samples, self.quota)
        while batch := list(itertools.islice(samples, self.batch_size)):
            yield to_device(self.collate_fn(batch), self.device)

    def evened(self) -> Iterator[tuple[Any, bool]]:
        """(batch, counted): this rank's batches, then uncounted repeats of one of them while any other rank
        still has a batch — every rank runs as many forward passes (one small agreement per batch). A rank
        with no sample of its own repeats the data set's first."""
        batches, filler = iter(self), None
        while True:
            batch = next(batches, None)
            if not any(distributed.gather_objects(batch is not None)):
                return
            if batch is not None:
                filler = batch if filler is None else filler
                yield batch, True
                continue
            if filler is None:
                filler = to_device(self.collate_fn([next(iter(self.dataset))]), self.device)
            yield filler, False
