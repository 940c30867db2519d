"""Data sets, sharding and batching."""

from dtrain.data.batch import TensorDict, collate, to_device
from dtrain.data.datasets import (
    DataSplits,
    build,
    check,
    check_shardable,
    fetch,
    global_order_of,
    keeps_global_order,
    kind_of,
    sample_of,
    size_hint,
)
from dtrain.data.given import as_given
from dtrain.data.loaders import Batches, EvalBatches, TrainBatches, samples_in, train_batches
from dtrain.data.sampler import ShardSampler, eval_shard

__all__ = [
    "Batches",
    "DataSplits",
    "EvalBatches",
    "ShardSampler",
    "TensorDict",
    "TrainBatches",
    "as_given",
    "build",
    "check",
    "check_shardable",
    "collate",
    "eval_shard",
    "fetch",
    "global_order_of",
    "keeps_global_order",
    "kind_of",
    "sample_of",
    "samples_in",
    "size_hint",
    "to_device",
    "train_batches",
]
