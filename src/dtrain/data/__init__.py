"""Data sets, sharding and batching."""

from .batch import TensorDict, collate, to_device
from .datasets import DataSplits, build, check, prepare, size_hint
from .loaders import EvalBatches, TrainBatches
from .sampler import ShardSampler, eval_shard

__all__ = [
    "DataSplits",
    "EvalBatches",
    "ShardSampler",
    "TensorDict",
    "TrainBatches",
    "build",
    "check",
    "collate",
    "eval_shard",
    "prepare",
    "size_hint",
    "to_device",
]
