"""Where token shards are read from: a local folder (memory maps, exactly as fast as before) or an object
store URL such as `s3://bucket/prefix` (ranged requests for exactly the windows a batch needs; nothing of
the data set is copied to local disk).

Both give `TokenWindows` the same three things: a file's size, a small text file (meta.json, the
tokenizer) and `gather` — the token windows at given offsets of given shards, as int64 rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from dtrain import objstore
from dtrain.errors import DataError


def store_at(folder: str | Path) -> LocalFolder | RemoteFolder:
    """The store `data.path` names: a URL through fsspec, anything else a local folder."""
    return RemoteFolder(folder) if objstore.is_url(folder) else LocalFolder(folder)


class LocalFolder:
    remote = False

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)

    def where(self, name: str) -> str:
        return str(self.folder / name)

    def size(self, name: str) -> int | None:
        """A file's size in bytes; None when it is not there."""
        path = self.folder / name
        return path.stat().st_size if path.is_file() else None

    def read_text(self, name: str) -> str:
        return (self.folder / name).read_text(encoding="utf-8")

    def open(self, files: list[str], dtype: type[np.unsignedinteger]) -> LocalShards:
        return LocalShards([np.memmap(self.folder / f, dtype=dtype, mode="r") for f in files])


class LocalShards:
    """Memory-mapped shards: only the pages of the windows read are touched."""

    def __init__(self, maps: list[np.memmap]):
        self._maps = maps
        self.lengths = [len(m) for m in maps]

    def gather(self, shard: np.ndarray, first: np.ndarray, length: int) -> np.ndarray:
        """Row i: `length` tokens of shard[i] from token first[i], as int64; one vectorised read per shard."""
        windows = np.empty((len(shard), length), dtype=np.int64)
        offsets = np.arange(length)
        for s in np.unique(shard):
            rows = np.nonzero(shard == s)[0]
            windows[rows] = self._maps[s][first[rows, None] + offsets]
        return windows


class RemoteFolder:
    """A prefix of an object store. One listing gives every file's size; meta.json and the tokenizer are
    small objects read whole; shards are only ever read in ranges (RemoteShards)."""

    remote = True

    def __init__(self, url: str | Path):
        self.url = str(url).rstrip("/")
        self.fs, self.root = objstore.filesystem(self.url, "data.path")
        self._sizes: dict[str, int] | None = None

    def where(self, name: str) -> str:
        return objstore.join(self.url, name)

    def refused(self, exc: BaseException) -> objstore.StorageError | None:
        return objstore.refusal(exc, self.url, "data.path", self.fs, self.root)

    def size(self, name: str) -> int | None:
        if self._sizes is None:
            try:
                entries = self.fs.ls(self.root, detail=True)
            except Exception as exc:
                refused = self.refused(exc)
                if refused is not None:
                    raise refused from None
                if not isinstance(exc, FileNotFoundError):
                    raise
                entries = []  # an empty prefix: meta.json is then said to be missing
            self._sizes = {e["name"].rsplit("/", 1)[-1]: int(e["size"]) for e in entries if e.get("type") == "file"}
        return self._sizes.get(name)

    def read_text(self, name: str) -> str:
        try:
            data = self.fs.cat_file(f"{self.root}/{name}")
        except Exception as exc:
            refused = self.refused(exc)
            if refused is not None:
                raise refused from None
            raise
        return data.decode("utf-8")  # a UnicodeDecodeError is the caller's to say (not a JSON file)

    def open(self, files: list[str], dtype: type[np.unsignedinteger]) -> RemoteShards:
        itemsize = np.dtype(dtype).itemsize
        sizes = [self.size(f) for f in files]
        if any(s is None for s in sizes):
            missing = files[sizes.index(None)]
            raise DataError(f"{self.where(missing)} is missing (listed in {self.where('meta.json')})")
        paths = [f"{self.root}/{f}" for f in files]
        return RemoteShards(self, paths, [int(s or 0) // itemsize for s in sizes], dtype)


class RemoteShards:
    """Shards read by ranged requests: one GET per window of a batch, all of a batch's in flight at once
    (fsspec's `cat_ranges`, concurrent on s3fs), so a batch costs about one round trip whatever its size.
    No block cache: windows are drawn in a random order over the whole data set, so bytes read past a
    window would almost never be the next window's. The read-ahead is one batch (`read_ahead`, used by
    the batch loop: the next batch is fetched while this one trains), so memory holds at most two
    batches of tokens, whatever the data set's size."""

    read_ahead = True

    def __init__(self, folder: RemoteFolder, paths: list[str], lengths: list[int], dtype: Any):
        self._folder = folder
        self._paths = paths
        self._dtype = np.dtype(dtype)
        self.lengths = lengths

    def gather(self, shard: np.ndarray, first: np.ndarray, length: int) -> np.ndarray:
        size = self._dtype.itemsize
        starts = [int(f) * size for f in first]
        try:
            pieces = self._folder.fs.cat_ranges(
                [self._paths[s] for s in shard], starts, [s + length * size for s in starts], on_error="raise"
            )
        except Exception as exc:
            refused = self._folder.refused(exc)
            if refused is not None:
                raise refused from None
            raise
        windows = np.empty((len(shard), length), dtype=np.int64)
        for row, piece in enumerate(pieces):
            windows[row] = np.frombuffer(piece, dtype=self._dtype)
        return windows
