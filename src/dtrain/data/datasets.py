"""The data a job trains on: built-in sets (digits, mnist, synthetic, tokens) and user factories."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from dtrain import factory
from dtrain.config import Config, DataConfig
from dtrain.config.model import DATA_GIVES
from dtrain.data import mnist, packing, tokens
from dtrain.errors import DataError

# The held-out split of digits and synthetic data is fixed, whatever run.seed says, so that eval
# figures of different runs are comparable.
SPLIT_SEED = 1234
DIGITS_SHAPE = (64,)  # 8×8 pixels, flat as scikit-learn gives them


@dataclass
class DataSplits:
    train: Dataset
    eval: Dataset | None
    input_shape: tuple[int, ...]
    num_classes: int
    notes: list[str] = field(default_factory=list)  # what rank 0 says about the data (an eval set that is none)


def build(config: Config) -> DataSplits:
    """The train and eval sets `config.data` describes."""
    data = config.data
    if data.name == "digits":
        return _digits(data)
    if data.name == "mnist":
        return _mnist(data)
    if data.name == "synthetic":
        return _synthetic(data, config.run.seed)
    if data.name == "tokens":
        return _tokens(data)
    return _from_factory(config)


def size_hint(config: Config) -> int | None:
    """Training-set size known without loading the data (None when only loading would tell)."""
    data = config.data
    if data.name == "digits":
        return 1797 - _held_out(1797, data.eval_fraction)
    if data.name == "synthetic":
        return data.num_samples - _held_out(data.num_samples, data.eval_fraction)
    if data.name == "mnist":
        files = mnist.find_files(data.path)
        if files is not None and files["train_labels"].suffix != ".gz":
            return max(0, files["train_labels"].stat().st_size - 8)  # one byte per label
    if data.name == "tokens":
        return tokens.windows_in(tokens.read_meta(data.path), "train", data.block_size, data.path)
    return None


def sample_of(config: Config) -> tuple[tuple[int, ...], int] | None:
    """A built-in data set's sample shape and classes (the vocabulary, for tokens: meta.json), known
    without loading it: what the launcher builds the model for, to see that it can be. None for a
    factory's, which only building tells."""
    data = config.data
    if data.name == "digits":
        return DIGITS_SHAPE, 10
    if data.name == "mnist":
        return mnist.SHAPE, 10
    if data.name == "synthetic":
        return tuple(data.input_shape), data.num_classes
    if data.name == "tokens":
        return (data.block_size,), tokens.read_meta(data.path)["vocab_size"]
    return None


def check(config: Config, world_size: int = 1) -> None:
    """The launcher reads files a job names before any worker starts: content, not only form (MNIST:
    every image 28×28, every label a digit, as many labels as images; tokens: meta.json and the shards
    it lists, enough windows for one global batch)."""
    data = config.data
    if data.sampling == "random" and ":" not in data.name and data.name != "tokens":
        raise DataError(random_needs_tokens(data.name))
    if data.name == "mnist":
        mnist.load(data.path)
    if data.name == "tokens":
        tokens.check_block_size(tokens.read_meta(data.path), data.block_size, data.path, world_size, data.batch_size)


def random_needs_tokens(what: str) -> str:
    return (
        f"data.sampling = random draws token windows at random offsets (data.name = tokens, or token windows "
        f"given in code); the training data here is {what}: use data.sampling = windows"
    )


def fetch(config: Config) -> None:
    """Work that must happen once per node before workers start (downloads)."""
    data = config.data
    if data.name == "mnist" and mnist.find_files(data.path) is None:
        if not data.download:
            raise DataError(mnist.missing_files_message(data.path))
        mnist.download(data.path)


def _held_out(n: int, fraction: float) -> int:
    return max(1, int(round(n * fraction)))


def _split(x: torch.Tensor, y: torch.Tensor, fraction: float) -> tuple[TensorDataset, TensorDataset]:
    generator = torch.Generator().manual_seed(SPLIT_SEED)
    order = torch.randperm(len(x), generator=generator)
    n_eval = _held_out(len(x), fraction)
    ev, tr = order[:n_eval], order[n_eval:]
    return TensorDataset(x[tr], y[tr]), TensorDataset(x[ev], y[ev])


def _digits(data: DataConfig) -> DataSplits:
    pixels, labels = digits_arrays()
    x = torch.tensor(pixels, dtype=torch.float32) / 16.0  # pixels are 0..16
    y = torch.tensor(labels, dtype=torch.int64)
    train, ev = _split(x, y, data.eval_fraction)
    return DataSplits(train, ev, input_shape=DIGITS_SHAPE, num_classes=10)


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's handwritten digits (1797 rows of 64 pixels, and their labels), read from the file
    scikit-learn ships, as its load_digits does, without importing scikit-learn: that import alone
    costs a worker about 1.5 s before its first step. Its own loader where the file is not found."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    folders = spec.submodule_search_locations if spec is not None else None
    csv = Path(folders[0]) / "datasets" / "data" / "digits.csv.gz" if folders else None
    if csv is None or not csv.is_file():
        from sklearn.datasets import load_digits

        digits = load_digits()
        return digits.data, digits.target
    table = np.loadtxt(csv, delimiter=",")
    return table[:, :-1], table[:, -1].astype(int)


def _mnist(data: DataConfig) -> DataSplits:
    if mnist.find_files(data.path) is None and data.download:
        mnist.download(data.path)
    (train_x, train_y), (test_x, test_y) = mnist.load(data.path)
    return DataSplits(
        TensorDataset(train_x, train_y), TensorDataset(test_x, test_y), input_shape=mnist.SHAPE, num_classes=10
    )


def _tokens(data: DataConfig) -> DataSplits:
    meta = tokens.read_meta(data.path)
    windows = packing.PackedWindows if data.packing else tokens.TokenWindows
    train = windows(data.path, "train", data.block_size, meta)
    val = windows(data.path, "val", data.block_size, meta) if "val" in meta["splits"] else None
    held_out = meta["splits"].get("val", {}).get("tokens", 0)
    notes = [] if val is not None and len(val) else [tokens.no_eval_windows(data.path, held_out, data.block_size)]
    return DataSplits(
        train,
        val if val is not None and len(val) else None,
        input_shape=(data.block_size,),
        num_classes=meta["vocab_size"],
        notes=notes,
    )


def _synthetic(data: DataConfig, seed: int) -> DataSplits:
    """Gaussian inputs labelled by a fixed random linear teacher: learnable, and cheap to make."""
    generator = torch.Generator().manual_seed(seed)
    shape = tuple(data.input_shape)
    x = torch.randn((data.num_samples, *shape), generator=generator)
    teacher = torch.randn((x[0].numel(), data.num_classes), generator=generator)
    y = (x.flatten(1) @ teacher).argmax(dim=1)
    train, ev = _split(x, y, data.eval_fraction)
    return DataSplits(train, ev, input_shape=shape, num_classes=data.num_classes)


def _from_factory(config: Config) -> DataSplits:
    """A user factory returns a training set, or (train, eval), or a dict with 'train'/'eval'."""
    name = config.data.name
    fn = factory.resolve("data.name", name)
    result: Any = factory.call(fn, {"config": config}, {})
    train, ev = _unpack(result)
    _check_dataset(name, "its training set", train)
    if ev is not None:
        _check_dataset(name, "its eval set", ev)
    try:
        input_shape = infer_input_shape(train)
    except Exception as exc:
        raise DataError(
            f"data.name = '{name}': its first training sample cannot be read as (input, label) "
            f"({type(exc).__name__}: {exc})"
        ) from None
    return DataSplits(train, ev, input_shape=input_shape, num_classes=infer_num_classes(train, config.data.num_classes))


def _check_dataset(name: str, what: str, dataset: Any) -> None:
    """A map-style dataset: indexable and sized (a str or a dict is neither), and not empty."""
    usable = (
        (isinstance(dataset, Dataset) or hasattr(dataset, "__getitem__"))
        and hasattr(dataset, "__len__")
        and not isinstance(dataset, (str, bytes, dict))
    )
    if not usable:
        raise DataError(
            f"data.name = '{name}' returned {type(dataset).__name__} as {what}; it must return a "
            f"map-style Dataset (with __getitem__ and __len__), (train, eval) or "
            f"{{'train': ..., 'eval': ...}}"
        )
    try:
        size = len(dataset)
    except Exception as exc:
        raise DataError(f"data.name = '{name}': len() of {what} failed ({type(exc).__name__}: {exc})") from None
    if size == 0:
        raise DataError(f"data.name = '{name}' returned an empty dataset as {what}")


def _unpack(result: Any) -> tuple[Any, Any]:
    if isinstance(result, DataSplits):
        return result.train, result.eval
    if isinstance(result, dict):
        return result.get("train"), result.get("eval")
    if isinstance(result, (tuple, list)) and len(result) == 2:
        return result[0], result[1]
    return result, None


def infer_input_shape(dataset: Dataset) -> tuple[int, ...]:
    sample = dataset[0]
    x = sample[0] if isinstance(sample, (tuple, list)) else sample
    return tuple(torch.as_tensor(x).shape)


def kind_of(config: Config, dataset: Dataset) -> str | None:
    """The kind of samples the training set gives, as a built-in model checks what it takes: a built-in
    set's is declared (DATA_GIVES); a factory's is 'tokens' when its inputs are integers (token ids), else
    'features', read from its first sample (None when that input is no tensor: a dict)."""
    if config.data.name in DATA_GIVES:
        return DATA_GIVES[config.data.name]
    sample = dataset[0]
    try:
        x = torch.as_tensor(sample[0] if isinstance(sample, (tuple, list)) else sample)
    except (TypeError, ValueError, RuntimeError):
        return None
    return "features" if x.is_floating_point() or x.dtype == torch.bool else "tokens"


def infer_num_classes(dataset: Dataset, default: int) -> int:
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) >= 2:
        labels = dataset.tensors[1]
        if not labels.is_floating_point() and labels.dim() == 1 and len(labels):
            return max(int(labels.max()) + 1, 2)
    return default


def check_shardable(config: Config, n_train: int, world_size: int) -> None:
    """Every process needs at least one training sample of its own."""
    if n_train < world_size:
        raise DataError(
            f"data set '{config.data.name}' has {n_train} training samples, too few for "
            f"{world_size} processes; use --nproc {max(1, n_train)} or fewer"
        )


# --- world-size-independent order -------------------------------------------------------------------


def keeps_global_order(dataset: Any, sampling: str = "windows") -> bool:
    """Whether a training set asks to be served in an order that does not depend on the world size (it
    says so with `global_order = True`, as token windows do): the same global batches on any number of
    processes, so a run can resume on another (GlobalOrderSampler, checkpoint.state.regroup). Windows at
    random offsets (data.sampling = random) are drawn per rank: never."""
    return sampling == "windows" and getattr(dataset, "global_order", False) is True


def global_order_of(config: Config) -> bool | None:
    """`keeps_global_order` before the data is built (the launcher's question): known for the built-in
    sets, None for a user factory's, which only the built data set can answer."""
    if ":" in config.data.name:
        return None
    return config.data.name == "tokens" and keeps_global_order(tokens.TokenWindows, config.data.sampling)
