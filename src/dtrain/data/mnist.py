"""MNIST from its four IDX files (plain or gzipped), with an optional, verified download."""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dtrain.errors import DataError
from dtrain.files import user_file_mode

FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
SHAPE = (1, 28, 28)  # one sample as the model sees it: a grey channel of 28×28 pixels
# The same mirrors and checksums torchvision uses.
MIRRORS = ["https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/"]
MD5 = {
    "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
}
_IDX_DTYPES: dict[int, Any] = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def find_files(root: str | Path) -> dict[str, Path] | None:
    """The four files under `root` (or torchvision's `root/MNIST/raw`), plain or .gz; None if any is missing."""
    for folder in (Path(root), Path(root) / "MNIST" / "raw"):
        found = {}
        for key, stem in FILES.items():
            for candidate in (folder / stem, folder / f"{stem}.gz"):
                if candidate.is_file():
                    found[key] = candidate
                    break
        if len(found) == len(FILES):
            return found
    return None


def missing_files_message(root: str | Path, fetch: str = "set data.download=true", key: str = "data.path") -> str:
    return (
        f"{key} = '{root}' does not hold the MNIST IDX files ({', '.join(FILES.values())}, "
        f"plain or .gz); put them there or {fetch}"
    )


def read_idx(path: Path) -> np.ndarray:
    """Parse one IDX file: 2 zero bytes, a type code, the number of dimensions, sizes, then data."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:
            raw = fh.read()
    except (OSError, EOFError) as exc:
        raise DataError(
            f"cannot read {path}: {exc}; replace the file (or delete it and set data.download=true)"
        ) from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise DataError(f"{path} is not an IDX file (bad header); replace it with the original MNIST file")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    offset = 4 + 4 * ndim
    expected = int(np.prod(dims)) * dtype.itemsize
    if len(raw) - offset != expected:
        raise DataError(
            f"{path} is truncated or corrupt: header promises {expected} bytes of data, "
            f"found {len(raw) - offset}; replace the file"
        )
    return np.frombuffer(raw, dtype=dtype, offset=offset).reshape(dims)


def load(
    root: str | Path, fetch: str = "set data.download=true", key: str = "data.path"
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """((train_x, train_y), (test_x, test_y)); x is float32 N×1×28×28 in [0, 1] like ToTensor gives.
    `fetch` and `key`: how the caller's user asks for the download and names the folder, said when the
    files are missing (a script's own flags: "pass --download", "--data")."""
    files = find_files(root)
    if files is None:
        raise DataError(missing_files_message(root, fetch, key))

    def images(key: str) -> torch.Tensor:
        arr = read_idx(files[key])
        if arr.ndim != 3 or arr.shape[1:] != (28, 28):
            raise DataError(f"{files[key]} holds images of shape {list(arr.shape)}; MNIST images are N×28×28")
        return torch.from_numpy(arr.astype(np.float32) / 255.0).unsqueeze(1)

    def labels(key: str) -> torch.Tensor:
        arr = read_idx(files[key])
        if arr.ndim != 1:
            raise DataError(f"{files[key]} holds {arr.ndim}-D data; MNIST labels are one number per image")
        if len(arr) and (arr.min() < 0 or arr.max() > 9):
            raise DataError(
                f"{files[key]} holds label {int(arr.max() if arr.max() > 9 else arr.min())}; MNIST "
                f"labels are the digits 0-9 (a file of another data set?)"
            )
        return torch.from_numpy(arr.astype(np.int64))

    train = images("train_images"), labels("train_labels")
    test = images("test_images"), labels("test_labels")
    for (x, y), key in ((train, "train_labels"), (test, "test_labels")):
        if len(x) != len(y):
            raise DataError(f"{files[key]} has {len(y)} labels for {len(x)} images; the files do not belong together")
    return train, test


def download(root: str | Path) -> None:
    """Fetch the four gzipped files into `root`, checking each MD5; written atomically. A download that
    fails leaves no folder it created behind (an empty `root` would look like data that is there)."""
    root = Path(root)
    created = [folder for folder in (root, *root.absolute().parents) if not folder.exists()]
    root.mkdir(parents=True, exist_ok=True)
    try:
        _fetch_into(root)
    except BaseException:
        for folder in created:  # deepest first; one that holds anything (another process's files) stays
            try:
                folder.rmdir()
            except OSError:
                break
        raise


def _fetch_into(root: Path) -> None:
    for name, md5 in MD5.items():
        target = root / name
        if target.is_file() and _md5(target) == md5:
            continue
        errors = []
        for mirror in MIRRORS:
            fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{name}.")
            try:
                with os.fdopen(fd, "wb") as out, urllib.request.urlopen(mirror + name, timeout=60) as r:
                    shutil.copyfileobj(r, out)
                if _md5(Path(tmp)) != md5:
                    raise OSError("checksum mismatch")
                os.chmod(tmp, user_file_mode())  # mkstemp's 0600: the user's normal mode instead
                os.replace(tmp, target)
                break
            except OSError as exc:
                errors.append(f"{mirror}: {exc}")
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        else:
            raise DataError(
                f"could not download {name} into {root} ({'; '.join(errors)}); "
                f"download the MNIST IDX files by hand into {root}"
            )


def _md5(path: Path) -> str:
    digest = hashlib.md5()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
