"""Files that are whole or absent: atomic writes, checksummed manifests, and the run-directory lock."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..errors import DtrainError
from ..rundir import WEIGHTS_MARK


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` so that readers see the old file or the whole new one, never a part."""
    _atomic(path, lambda tmp: Path(tmp).write_text(text))


def save_final_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    """The trained weights (a full state dict on the CPU) as safetensors, loadable without pickle,
    written atomically. Tensors stored once under several names (tied embeddings) are written once,
    under the first name in sorted order, the others noted in the metadata: what safetensors'
    `save_model` does, so `load_model` reads the file back into the model."""
    metadata = dict(WEIGHTS_MARK)
    unique: dict[str, torch.Tensor] = {}
    kept: dict[tuple[int, int], str] = {}
    for name in sorted(state):
        tensor = state[name]
        where = (tensor.untyped_storage().data_ptr(), tensor.storage_offset()) if tensor.numel() else (0, id(tensor))
        if where in kept and state[kept[where]].shape == tensor.shape:
            metadata.setdefault(name, kept[where])
            continue
        kept[where] = name
        unique[name] = tensor.contiguous()
    _atomic(path, lambda tmp: save_file(unique, tmp, metadata=metadata))


def _atomic(path: Path, write: Callable[[str], object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        # mkstemp makes the file 0600 (and a writer may recreate it): what dtrain writes gets the
        # user's normal mode, 0666 less the umask, like any file a program creates.
        os.chmod(tmp, user_file_mode())
        fsync_file(Path(tmp))
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- manifests: what a complete checkpoint holds, byte for byte ------------------------------------


def crc32(path: Path) -> int:
    value = 0
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            value = zlib.crc32(block, value)
    return value


MARKER = "COMPLETE.json"  # what seals a checkpoint folder: its manifest, written last


def manifest_names(folder: Path) -> list[str]:
    return [str(p.relative_to(folder)) for p in sorted(folder.rglob("*")) if p.is_file()]


def manifest(folder: Path) -> dict[str, dict[str, int]]:
    """Size and CRC-32 of every file under `folder` (relative paths)."""
    return {
        str(p.relative_to(folder)): {"bytes": p.stat().st_size, "crc32": crc32(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def verify(folder: Path, expected: dict[str, dict[str, int]]) -> str | None:
    """None when `folder` holds exactly what `expected` lists; else what is wrong, naming the file."""
    unlisted = sorted(set(manifest_names(folder)) - set(expected) - {MARKER})
    if unlisted:
        return f"{folder / unlisted[0]} is not in its manifest (the marker omits it)"
    for name, want in expected.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != want["bytes"]:
            return f"{path} is truncated or altered ({size} bytes, {want['bytes']} expected)"
        if crc32(path) != want["crc32"]:
            return f"{path} is corrupt (checksum mismatch)"
    return None


# --- one live run per run directory ---------------------------------------------------------------


class RunDirLock:
    """An exclusive lock on `<run.dir>/.lock`, held by rank 0 for the life of the run.

    flock is released by the kernel when the holder dies, so a crashed or killed run never leaves a
    stale lock behind (a restarted rank 0 simply takes it again).
    """

    def __init__(self, run_dir: Path):
        self.path = run_dir / ".lock"
        self._fd: int | None = None
        self._created_dir = self._created_file = False

    def acquire(self) -> None:
        self._created_dir = not self.path.parent.exists()
        self._created_file = not self.path.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:  # never through a symlink: the lock's content would land in whatever file it points to
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)  # less the umask
        except OSError as exc:
            raise DtrainError(
                f"{self.path} cannot be used as the run's lock ({exc.strerror}: a symlink or not "
                f"a file?); move it, or choose another run.dir"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            error = self._in_use(fd)
            os.close(fd)
            raise error from None
        os.ftruncate(fd, 0)
        os.write(
            fd,
            json.dumps(
                {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
            ).encode(),
        )
        self._fd = fd

    def check_free(self) -> None:
        """Refuse now if another live run holds the lock (without taking it or creating anything)."""
        if not self.path.exists():
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise self._in_use(fd) from None
        finally:
            os.close(fd)

    def _in_use(self, fd: int) -> DtrainError:
        return DtrainError(
            f"run.dir {self.path.parent} is in use by another run ({_read_holder(fd)}); "
            f"wait for it to finish or choose another run.dir"
        )

    def release(self, remove_if_created: bool = False) -> None:
        """Drop the lock; on a refused start, also remove a run.dir this lock created (and nothing
        else was written to)."""
        if self._fd is None:
            return
        os.close(self._fd)  # closing drops the flock
        self._fd = None
        if remove_if_created and self._created_file:
            self.path.unlink(missing_ok=True)
            if self._created_dir and not any(self.path.parent.iterdir()):
                self.path.parent.rmdir()


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"pid {info['pid']} on {info['host']}, since {info['since']}"
    except (ValueError, KeyError, OSError):
        return "holder unknown"


def user_file_mode(folder: bool = False) -> int:
    """The mode a program's new file (0666) or folder (0777) gets under the user's umask."""
    mask = os.umask(0)  # the only way to read it is to set it: set it straight back
    os.umask(mask)
    return (0o777 if folder else 0o666) & ~mask
