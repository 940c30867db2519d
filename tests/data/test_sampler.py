"""Sharding: DistributedSampler's exact order, every sample once per epoch, batches gathered by index."""

import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler, TensorDataset

from dtrain.config import DataConfig
from dtrain.data import EvalBatches, ShardSampler, TrainBatches, eval_shard

CPU = torch.device("cpu")


@pytest.mark.parametrize("n, world, seed", [(100, 2, 0), (101, 2, 3), (7, 3, 11), (5, 8, 1), (64, 4, 42)])
def test_matches_distributed_sampler_index_for_index(n, world, seed):
    data = list(range(n))
    for epoch in range(3):
        for rank in range(world):
            reference = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=seed)
            reference.set_epoch(epoch)
            ours = ShardSampler(n, rank, world, seed=seed)
            ours.set_epoch(epoch)
            assert list(ours) == list(reference)
            assert ours.shard(epoch).tolist() == list(reference)
            assert len(ours) == len(reference)


def test_shuffle_false_is_the_data_sets_own_order_for_both_samplers():
    """data.shuffle = false: DistributedSampler(shuffle=False)'s order, every epoch; for token windows
    (an order independent of the world size) global batch k holds samples k × global batch onwards."""
    from dtrain.data.sampler import train_sampler

    for rank in range(3):
        reference = list(DistributedSampler(list(range(10)), num_replicas=3, rank=rank, shuffle=False))
        ours = train_sampler(10, rank, 3, 2, seed=4, accum=1, global_order=False, shuffle=False)
        assert ours.shard(0).tolist() == ours.shard(5).tolist() == reference
    windows = [train_sampler(26, r, 2, 3, seed=4, accum=2, global_order=True, shuffle=False) for r in (0, 1)]
    assert windows[0].shard(1).tolist() == [0, 1, 2, 6, 7, 8, 12, 13, 14, 18, 19, 20]
    assert windows[1].shard(1).tolist() == [3, 4, 5, 9, 10, 11, 15, 16, 17, 21, 22, 23]


def test_every_sample_once_per_epoch_and_a_new_order_each_epoch():
    n, world = 203, 2  # 1 padded sample
    orders = []
    for epoch in range(3):
        shards = [ShardSampler(n, r, world, seed=5).shard(epoch) for r in range(world)]
        together = torch.cat(shards)
        assert len(together) == n + 1
        assert set(together.tolist()) == set(range(n))
        counts = torch.bincount(together, minlength=n)
        assert int((counts == 2).sum()) == 1  # the padding, and nothing else, repeats
        orders.append(shards[0].tolist())
    assert orders[0] != orders[1] != orders[2]


def test_eval_shards_cover_each_sample_exactly_once():
    n, world = 101, 4
    together = torch.cat([eval_shard(n, r, world) for r in range(world)])
    assert sorted(together.tolist()) == list(range(n))


def indexed(n):
    """Inputs that carry their own index, so batches reveal which samples they hold."""
    return TensorDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.arange(n))


class MapStyle(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([float(i)]), i


@pytest.mark.parametrize("make", [indexed, MapStyle], ids=["tensors", "dataloader"])
def test_train_batches_follow_the_shard_grouped_for_accumulation(make):
    n, world, batch, accum = 50, 2, 4, 3
    for rank in range(world):
        sampler = ShardSampler(n, rank, world, seed=9)
        batches = TrainBatches(make(n), sampler, DataConfig(batch_size=batch), accum, CPU)
        groups = list(batches.epoch(1))
        assert len(groups) == batches.steps_per_epoch == 3  # 25 samples: 7 micro-batches
        assert [len(g) for g in groups] == [3, 3, 1]
        seen = torch.cat([y for g in groups for _, y in g])
        assert seen.tolist() == sampler.shard(1).tolist()
        # Resuming at step 1 of the epoch continues exactly where step 0 ended.
        later = torch.cat([y for g in batches.epoch(1, start_step=1) for _, y in g])
        assert later.tolist() == sampler.shard(1)[batch * accum :].tolist()


def test_drop_last_drops_only_the_partial_batch():
    sampler = ShardSampler(50, 0, 2, seed=0)
    batches = TrainBatches(indexed(50), sampler, DataConfig(batch_size=4, drop_last=True), 1, CPU)
    sizes = [len(g[0][1]) for g in batches.epoch(0)]
    assert sizes == [4] * 6


def test_eval_batches_hold_no_padding():
    data = indexed(11)
    seen = []
    for rank in range(3):
        for _, y in EvalBatches(data, rank, 3, DataConfig(eval_batch_size=2), CPU):
            seen += y.tolist()
    assert sorted(seen) == list(range(11))
    # A rank with nothing to evaluate yields no (empty) batch at all.
    assert list(EvalBatches(indexed(1), 1, 2, DataConfig(), CPU)) == []
