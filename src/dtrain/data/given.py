"""What the user hands the Trainer as training and eval data: a data set, a dict of equally long tensors, or
a `DataLoader` they already had.

From a `DataLoader` dtrain keeps what says how to load: its data set, `batch_size` (data.batch_size, per
process), `collate_fn` (unless the Trainer was given one), `num_workers`, `pin_memory`, `drop_last`,
`persistent_workers` and `prefetch_factor`, and whether it shuffled (a `RandomSampler`: data.shuffle). It
adds what distributed training needs and the loader cannot know: the rank's shard, each epoch's order
(set_epoch, by run.seed) and the position a resume continues from. Its sampler (a DistributedSampler
included), generator and worker_init_fn are not used. An eval loader gives its data set and batch size.
A torchdata `StatefulDataLoader` is taken the same way: over an iterable data set dtrain reads the rank's
share through a StatefulDataLoader of its own with those settings, and keeps its state per rank
(data.streams); over a map-style set the step says the position, as for any loader.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from torch.utils.data import DataLoader, RandomSampler, default_collate

from dtrain.config import Config
from dtrain.data import padding
from dtrain.data.batch import TensorDict
from dtrain.errors import ConfigError, DataError


def as_given(
    config: Config,
    train_data: Any,
    eval_data: Any,
    collate_fn: Callable[[list[Any]], Any] | None,
    model: Any = None,
) -> tuple[Config, Any, Any, Callable[[list[Any]], Any] | None]:
    """(config, train set, eval set, collate_fn) as the run uses them: a dict of tensors becomes a
    TensorDict; a DataLoader gives its data set and settings (`config` then is a copy saying them: the
    caller's is left as it was given); `data.padding = "longest"` gives the padding collator (the pad
    token id from `model`'s config unless data.pad_token_id says it)."""
    data = config.data
    if isinstance(train_data, DataLoader):
        loader = train_data
        batch_size = _batch_size(loader, "train_data")
        if collate_fn is None and loader.collate_fn is not default_collate:
            collate_fn = loader.collate_fn
        data = dataclasses.replace(
            data,
            batch_size=batch_size,
            num_workers=loader.num_workers,
            pin_memory=loader.pin_memory,
            drop_last=loader.drop_last,
            persistent_workers=loader.persistent_workers if loader.num_workers > 0 else data.persistent_workers,
            prefetch_factor=loader.prefetch_factor or data.prefetch_factor,
            shuffle=isinstance(loader.sampler, RandomSampler),
        )
        train_data = loader.dataset
    if isinstance(eval_data, DataLoader):
        data = dataclasses.replace(data, eval_batch_size=_batch_size(eval_data, "eval_data"))
        eval_data = eval_data.dataset
    if data.padding == "longest":
        if collate_fn is not None:
            raise ConfigError(
                "data.padding = 'longest' is a collate_fn of its own, and one was given too: drop one of them"
            )
        collate_fn = padding.from_config(data, model)
    if data.packing and getattr(getattr(model, "config", None), "use_cache", False):
        # With a cache to fill, transformers builds a plain causal mask and never looks for documents.
        raise ConfigError(
            "data.packing = true and the model's config has use_cache = true, under which a Hugging Face model "
            "attends across documents: set model.options = {use_cache = false} (or model.config.use_cache = False)"
        )
    if data is not config.data:
        config = dataclasses.replace(config, data=data)
    return config, _tensors(train_data), _tensors(eval_data), collate_fn


def _tensors(data: Any) -> Any:
    return TensorDict(data) if isinstance(data, Mapping) else data


def _batch_size(loader: DataLoader, name: str) -> int:
    if loader.batch_size is None:
        raise DataError(
            f"{name} is a DataLoader with a batch_sampler (or batch_size=None) of its own; dtrain batches by "
            f"the loader's batch_size over the rank's shard: give the DataLoader a batch_size, or hand in its "
            f"data set and set data.batch_size"
        )
    return loader.batch_size
