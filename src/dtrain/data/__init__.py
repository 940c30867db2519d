"""Data sets, sharding and batching."""

from .datasets import DataSplits, build, check, prepare, size_hint
from .loaders import EvalBatches, TrainBatches, to_device
from .sampler import ShardSampler, eval_shard

__all__ = ["DataSplits", "EvalBatches", "ShardSampler", "TrainBatches", "build", "check", "eval_shard",
           "prepare", "size_hint", "to_device"]
