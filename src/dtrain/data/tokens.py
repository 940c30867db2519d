"""Token data bigger than RAM: memory-mapped shards served as windows, in a global order.

The format (what `dtrain prepare` writes, and what any tool can write):

    DIR/meta.json        {"format": "dtrain-tokens", "version": 1, "dtype": "uint16" | "uint32",
                          "vocab_size": V, "tokenizer": "tokenizer.json" | "bytes", "eot_token": id,
                          "splits": {"train": {"files": ["train-00000.bin", ...], "tokens": N}, "val": {...}}}
    DIR/*.bin            the split's tokens, native little-endian integers of `dtype`, documents
                          separated by `eot_token`
    DIR/tokenizer.json   a Hugging Face `tokenizers` file (absent for "bytes": token = byte value)

Sample i of a split is a window of block_size + 1 consecutive tokens of one file (windows do not
overlap; a file's last, shorter piece is not used): input = the first block_size, target = the last
block_size. Only the windows a batch needs are read from the memory map: a process's memory does not
grow with the data set. Training with data.sampling = random (random_windows.py) reads windows that may
start at any token instead (`take_at`), still within one file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dtrain.data.batch import BatchGatherer
from dtrain.data.shard_store import store_at
from dtrain.errors import DataError

FORMAT = "dtrain-tokens"
DTYPES: dict[str, type[np.unsignedinteger]] = {"uint16": np.uint16, "uint32": np.uint32}


def read_meta(folder: str | Path) -> dict[str, Any]:
    """meta.json of a token folder (or object store prefix), checked for everything a run relies on; one
    line when it is not."""
    store = store_at(folder)
    path = store.where("meta.json")
    if store.size("meta.json") is None:
        if store.remote:
            raise DataError(
                f"{path} does not exist: data.path must be a prefix holding the files `dtrain prepare text ... "
                f"--out DIR` wrote into DIR (copied there as they are), or a local folder"
            )
        raise DataError(
            f"{path} does not exist: data.path must be a folder made by `dtrain prepare text ... "
            f"--out {folder}` (or holding the same format)"
        )
    try:
        meta = json.loads(store.read_text("meta.json"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path} is not readable JSON ({exc}); prepare the data again") from None

    def bad(what: str) -> DataError:
        return DataError(f"{path}: {what}; prepare the data again with `dtrain prepare text`")

    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise bad(f"'format' must be \"{FORMAT}\"")
    if not isinstance(meta.get("dtype"), str) or meta["dtype"] not in DTYPES:
        raise bad(f"'dtype' must be one of {', '.join(DTYPES)}; got {meta.get('dtype')!r}")
    vocab = meta.get("vocab_size")
    if (
        not isinstance(vocab, int)
        or isinstance(vocab, bool)
        or not 1 < vocab <= np.iinfo(DTYPES[meta["dtype"]]).max + 1
    ):
        raise bad(f"'vocab_size' must be an integer from 2 to what {meta['dtype']} holds; got {vocab!r}")
    splits = meta.get("splits")
    if not isinstance(splits, dict) or "train" not in splits:
        raise bad("'splits' must hold at least 'train'")
    itemsize = np.dtype(DTYPES[meta["dtype"]]).itemsize
    for name, split in splits.items():
        files, tokens = (split.get("files"), split.get("tokens")) if isinstance(split, dict) else (None, None)
        if (
            not isinstance(files, list)
            or not all(isinstance(f, str) and f and "/" not in f for f in files)
            or not isinstance(tokens, int)
            or isinstance(tokens, bool)
            or tokens < 0
        ):
            raise bad(f"split '{name}' needs 'files' (names in the folder) and 'tokens' (a count)")
        on_disk = 0
        for name_ in files:
            size = store.size(name_)
            if size is None:
                raise DataError(f"{store.where(name_)} is missing (listed in {path}); prepare the data again")
            if size % itemsize:
                raise DataError(
                    f"{store.where(name_)} is {size} bytes, not a whole number of {meta['dtype']} tokens; "
                    f"prepare the data again"
                )
            on_disk += size // itemsize
        if on_disk != tokens:
            raise bad(f"split '{name}' lists {tokens} tokens and its files hold {on_disk}")
    tokenizer = meta.get("tokenizer", "bytes")
    if tokenizer != "bytes" and not (isinstance(tokenizer, str) and store.size(tokenizer) is not None):
        raise bad(f"'tokenizer' must be \"bytes\" or a file in the folder; {tokenizer!r} is neither")
    return meta


class TokenWindows(BatchGatherer):
    """One split's windows of block_size + 1 tokens over memory-mapped shards; sample i is
    (input, target), each block_size int64 tokens."""

    global_order = True  # the sampler serves it in an order that does not depend on the world size

    def __init__(self, folder: str | Path, split: str, block_size: int, meta: dict[str, Any] | None = None):
        store = store_at(folder)
        self.folder: str | Path = folder if store.remote else Path(folder)
        self.meta = meta or read_meta(folder)
        self.block_size = block_size
        self.vocab_size = self.meta["vocab_size"]
        dtype = DTYPES[self.meta["dtype"]]
        files = [f for f in self.meta["splits"][split]["files"] if store.size(f)]  # an empty file maps nothing
        self._shards = store.open(files, dtype)
        # Object storage: the batch loop fetches the next batch while this one trains (RemoteShards).
        self.read_ahead = getattr(self._shards, "read_ahead", False)
        counts = [max(0, (n - 1) // block_size) for n in self._shards.lengths]
        self._starts = np.cumsum([0, *counts])  # window index where each file begins
        # data.sampling = random: every token a window of block_size + 1 can start at, file after file
        # (nanoGPT's len(data) - block_size for one file); a window never spans two files.
        self._offsets = np.cumsum([0, *(max(0, n - block_size) for n in self._shards.lengths)])

    @property
    def offsets(self) -> int:
        """How many windows of block_size + 1 tokens start somewhere in the split (random sampling)."""
        return int(self._offsets[-1])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.take(torch.tensor([index]))
        return x[0], y[0]

    def take(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The windows at `indices` as (inputs, targets), each (len(indices), block_size) int64: one
        vectorised read per shard (a ranged request per window on object storage), nothing else of the
        file touched."""
        idx = indices.cpu().numpy().astype(np.int64)
        if len(idx) and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"window index out of range 0..{len(self) - 1}")
        shard = np.searchsorted(self._starts, idx, side="right") - 1
        return self._read(shard, (idx - self._starts[shard]) * self.block_size)

    def take_at(self, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The windows starting at `offsets`, counted over the split's possible starts (0 .. offsets - 1,
        file after file), as (inputs, targets): random sampling's batch, nanoGPT's data[i : i + block_size + 1]."""
        at = offsets.cpu().numpy().astype(np.int64)
        if len(at) and (at.min() < 0 or at.max() >= self.offsets):
            raise IndexError(f"window offset out of range 0..{self.offsets - 1}")
        shard = np.searchsorted(self._offsets, at, side="right") - 1
        return self._read(shard, at - self._offsets[shard])

    def _read(self, shard: np.ndarray, first: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        windows = self._shards.gather(shard, first, self.block_size + 1)
        if len(shard) and (windows.max() >= self.vocab_size or windows.min() < 0):
            bad = int(windows.max())
            raise DataError(
                f"{self.folder}: a token id {bad} is outside the vocabulary (vocab_size "
                f"{self.vocab_size} in meta.json); the shards and meta.json do not belong together: "
                f"prepare the data again"
            )
        tokens = torch.from_numpy(windows)
        return tokens[:, :-1], tokens[:, 1:]


def windows_in(meta: dict[str, Any], split: str, block_size: int, folder: str | Path) -> int:
    """How many windows a split holds, from file sizes alone."""
    itemsize = np.dtype(DTYPES[meta["dtype"]]).itemsize
    store = store_at(folder)
    sizes = [(store.size(f) or 0) // itemsize for f in meta["splits"][split]["files"]]
    return sum(max(0, (n - 1) // block_size) for n in sizes)


def no_eval_windows(folder: str | Path, held_out: int, block_size: int) -> str:
    """The note for a token folder whose held-out split gives no window: the run trains, and does not
    evaluate."""
    if not held_out:
        return f"data.path = '{folder}' holds no held-out tokens: this run does not evaluate"
    return (
        f"data.path = '{folder}' holds {held_out:,} held-out tokens and not one window of data.block_size + 1 = "
        f"{block_size + 1} tokens in a file: this run does not evaluate; lower data.block_size, or prepare "
        f"more held-out text (--val-fraction)"
    )


def check_block_size(
    meta: dict[str, Any], block_size: int, folder: str | Path, world_size: int, batch_size: int
) -> None:
    """Enough windows of data.block_size + 1 tokens for one global batch."""
    n = windows_in(meta, "train", block_size, folder)
    need = batch_size * world_size
    if n < need:
        raise DataError(
            f"data.path = '{folder}' holds {n} training windows of data.block_size + 1 = {block_size + 1} "
            f"tokens, fewer than one global batch ({need} = data.batch_size × {world_size} "
            f"processes); lower data.block_size or data.batch_size, or prepare more text"
        )


def keep_tokenizer(folder: str | Path, run_dir: Path) -> None:
    """Copy meta.json and the tokenizer into run_dir/tokenizer/: what `dtrain generate` decodes with, so
    that a run can be sampled wherever it is read from and whatever becomes of data.path."""
    from dtrain.files import atomic_write_text

    out = run_dir / "tokenizer"
    meta = read_meta(folder)
    atomic_write_text(out / "meta.json", json.dumps(meta, indent=1) + "\n")
    if meta.get("tokenizer", "bytes") != "bytes":
        atomic_write_text(out / "tokenizer.json", store_at(folder).read_text(meta["tokenizer"]))


def read_kept_tokenizer_meta(run_dir: Path) -> dict[str, Any] | None:
    """The meta.json a run kept (keep_tokenizer), or None when it kept none."""
    path = run_dir / "tokenizer" / "meta.json"
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path} is not readable JSON ({exc})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("vocab_size"), int):
        raise DataError(f"{path} is not a token folder's meta.json")
    return meta
