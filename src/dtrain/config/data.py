"""[data]: the data a run trains and evaluates on, and how it is loaded."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal

from dtrain import objstore
from dtrain.config.model import DATA_GIVES
from dtrain.config.section import Section, check_builtin_or_factory
from dtrain.config.settings import setting
from dtrain.errors import ConfigError


@dataclass(slots=True)
class DataConfig(Section):
    name: str = setting(
        "digits",
        "digits (ships with scikit-learn), mnist (IDX files), synthetic, tokens "
        "(shards made by `dtrain prepare`), or a factory 'package.module:function'.",
    )
    path: str = setting(
        "data/mnist",
        "Folder holding the four MNIST IDX files (plain or .gz), or the token shards and meta.json (data.name=tokens; "
        "also a URL such as s3://bucket/prefix, read in ranges; credentials from boto's environment, never the URL).",
    )
    block_size: int = setting(
        256,
        "Tokens per training window (data.name=tokens): each sample is block_size inputs and their next tokens.",
        min=1,
        max=2**20,
    )
    download: bool = setting(False, "Download MNIST into data.path when the files are missing.")
    batch_size: int = setting(64, "Samples per micro-batch, per process.", min=1, max=2**24)
    eval_batch_size: int = setting(512, "Samples per evaluation batch, per process.", min=1, max=2**24)
    eval_fraction: float = setting(0.2, "Share held out for evaluation (digits, synthetic).", above=0, max=0.9)
    drop_last: bool = setting(False, "Drop each epoch's last, partial batch.")
    shuffle: bool = setting(
        True,
        "Shuffle the training set every epoch (by run.seed and the epoch); false: the data set's own order, "
        "rank r taking samples r, r + processes, ... (an iterable data set is always read in its own order).",
    )
    sampling: Literal["windows", "random"] = setting(
        "windows",
        "Token data (data.name=tokens): windows — the split cut into windows, every one once an epoch, in the "
        "epoch's order; random — nanoGPT's windows at random offsets, drawn per process from run.seed and "
        "resumed exactly, an epoch as many steps as with windows (evaluation keeps fixed windows).",
    )
    num_samples: int = setting(60000, "Size of the synthetic data set.", min=1, max=2**31)
    input_shape: list[int] = setting([1, 28, 28], "Sample shape of the synthetic data set.")
    num_classes: int = setting(
        10, "Classes of the synthetic data set (and of factory data sets that cannot say).", min=2
    )
    padding: str = setting(
        "none",
        "longest: pad each batch of token rows (dicts holding input_ids of different lengths) to its longest "
        "row, with attention_mask and -100 labels on the padding (dtrain.pad_to_longest); none: collate as given.",
    )
    pad_to_multiple_of: int = setting(1, "data.padding = longest: pad to a multiple of this (8 suits GPUs).", min=1)
    pad_token_id: int = setting(
        -1, "data.padding = longest: the pad token id; -1: the model config's pad_token_id.", min=-1
    )
    packing: bool = setting(
        False,
        "data.name = tokens: mark the documents in each window (position ids restart after every end-of-text "
        "token), attend within a document only, and leave out the loss of a document's first token.",
    )
    on_device: bool = setting(True, "Hold tensor data sets on the GPU and gather batches there.")
    num_workers: int = setting(
        0,
        "DataLoader worker processes (an iterable data set's are given every W-th sample of the rank's share).",
        min=0,
        max=1024,
    )
    pin_memory: bool = setting(True, "Pin host batches for faster copies to the GPU (DataLoader, CUDA only).")
    persistent_workers: bool = setting(True, "Keep DataLoader workers alive between epochs.")
    prefetch_factor: int = setting(2, "Batches each DataLoader worker loads ahead.", min=1, max=2**16)

    def check(self) -> None:
        self.path = os.path.expanduser(self.path)  # as run.dir
        if objstore.credentials_in(self.path):  # it would be written into config.toml and the logs
            raise ConfigError(
                f"data.path = '{objstore.without_credentials(self.path)}' carries a password in the URL; give "
                f"credentials through the store's environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, a "
                f"profile) and only the URL here"
            )
        check_builtin_or_factory("data.name", self.name, tuple(DATA_GIVES))
        if self.padding not in ("none", "longest"):
            raise ConfigError(f"data.padding = {self.padding!r} must be 'none' or 'longest'")
        if self.packing and self.name != "tokens":
            raise ConfigError(f"data.packing = true packs token data (data.name = 'tokens'), not {self.name!r}")
        if not self.input_shape or any(d < 1 for d in self.input_shape):
            raise ConfigError(
                f"data.input_shape = {self.input_shape} must be a list of positive sizes, e.g. [1, 28, 28]"
            )
        if self.name == "synthetic" and math.prod(self.input_shape) * self.num_samples > 2**34:
            raise ConfigError(
                f"data.input_shape = {self.input_shape} × data.num_samples = "
                f"{self.num_samples} is over 2^34 values (64 GiB of float32) for the synthetic "
                f"data set; use fewer samples or smaller inputs"
            )
