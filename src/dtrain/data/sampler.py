"""Which samples each rank sees, in which order.

`ShardSampler` reproduces `DistributedSampler(shuffle=True, seed=seed)` index for index (padding
included), but hands out the shard as one tensor so in-memory data can be gathered a whole batch at a
time, and it steps to a new order every epoch by itself. `GlobalOrderSampler` (token data) makes the
order independent of the world size: global batch k holds the same samples however many processes
train, as MosaicML Streaming promises — so a run can later resume on another number of processes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from dtrain.errors import DataError


class ShardSampler(Sampler[int]):
    """A rank's share of `n` samples for one epoch, with DistributedSampler's order and padding."""

    def __init__(self, n: int, rank: int, world_size: int, seed: int = 0, shuffle: bool = True):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.n = n
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        # Every rank gets ceil(n / world) samples; the shortfall is padded with samples from the
        # start of the order so that all ranks run the same number of steps.
        self.num_samples = math.ceil(n / world_size)
        self.total_size = self.num_samples * world_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def shard(self, epoch: int | None = None) -> torch.Tensor:
        """This rank's indices for `epoch` (default: the current one) as a LongTensor."""
        epoch = self.epoch if epoch is None else epoch
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + epoch)
            order = torch.randperm(self.n, generator=generator)
        else:
            order = torch.arange(self.n)
        if self.total_size > self.n:
            # DistributedSampler appends indices[:pad] (repeating the list as often as needed):
            # position i of the padded order is order[i % n].
            order = order.repeat(math.ceil(self.total_size / self.n))[: self.total_size]
        return order[self.rank : self.total_size : self.world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.shard().tolist())

    def __len__(self) -> int:
        return self.num_samples


class GlobalOrderSampler(ShardSampler):
    """A rank's share of `n` samples for one epoch, in an order that does not depend on the world size.

    The epoch's permutation of all n samples is cut into global batches of batch_size × world_size;
    global batch k is the same set of samples however many processes train (at the same global batch
    size), and rank r takes its contiguous slice of each. Samples left over after the last whole
    optimizer step wait for another epoch's permutation: no padding, every rank the same number of
    batches."""

    def __init__(
        self, n: int, rank: int, world_size: int, batch_size: int, seed: int = 0, accum: int = 1, shuffle: bool = True
    ):
        super().__init__(n, rank, world_size, seed=seed, shuffle=shuffle)
        self.batch_size = batch_size
        # Whole optimizer steps (accum global batches each): an epoch then holds the same steps whatever
        # the world size, when accumulation makes up for fewer processes.
        self.global_batches = n // (batch_size * world_size * accum) * accum
        self.num_samples = self.global_batches * batch_size
        self.total_size = self.num_samples * world_size

    def shard(self, epoch: int | None = None) -> torch.Tensor:
        epoch = self.epoch if epoch is None else epoch
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + epoch)
            order = torch.randperm(self.n, generator=generator)[: self.total_size]
        else:
            order = torch.arange(self.total_size)
        return order.view(self.global_batches, self.world_size, self.batch_size)[:, self.rank].reshape(-1)


def train_sampler(
    n: int, rank: int, world_size: int, batch_size: int, seed: int, accum: int, global_order: bool, shuffle: bool = True
) -> ShardSampler:
    """DistributedSampler's order of `n` samples; for data that asks for it (`global_order`: token
    windows) an order that does not depend on the world size, which needs one whole global batch.
    Without `shuffle`, the data set's own order (data.shuffle = false)."""
    if not global_order:
        return ShardSampler(n, rank, world_size, seed=seed, shuffle=shuffle)
    sampler = GlobalOrderSampler(n, rank, world_size, batch_size, seed=seed, accum=accum, shuffle=shuffle)
    if sampler.global_batches == 0:
        raise DataError(
            f"the training set has {n} samples, fewer than one global batch "
            f"(data.batch_size={batch_size} × {world_size} processes); lower "
            f"data.batch_size (or data.block_size for token data)"
        )
    return sampler


def eval_shard(n: int, rank: int, world_size: int) -> torch.Tensor:
    """Indices a rank evaluates: every sample exactly once across ranks, no padding.

    Evaluation runs no collective inside the forward pass, so ranks may hold one sample more or less;
    not padding means no duplicate is ever counted and the reduced metric equals a one-process eval.
    """
    return torch.arange(rank, n, world_size)


class IndexSampler(Sampler[int]):
    """Yields a fixed list of indices (used to feed a DataLoader a precomputed shard)."""

    def __init__(self, indices: torch.Tensor):
        self.indices = indices

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices.tolist())

    def __len__(self) -> int:
        return len(self.indices)
