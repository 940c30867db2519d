"""One live run per run directory: an flock on `<run.dir>/.lock`."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from dtrain.errors import DtrainError


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

    def held(self) -> bool:
        """Whether a live run holds the lock now (`dtrain generate` and `dtrain export` of a run still training)."""
        try:
            self.check_free()
        except DtrainError:
            return True
        return False

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
