"""One live run per run directory: an flock on `<run.dir>/.lock`."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import time
from pathlib import Path

from dtrain.errors import DtrainError

# A holder killed a moment ago still holds its lock until the last of its threads has closed its files
# (its main thread shows as a zombie before that): a rerun right after `kill -9`, the OOM killer or a
# preemption waits this long for the kernel to drop it instead of calling a dead run "in use".
RELEASE_WAIT_S = 10.0
_PF_EXITING = 0x4  # /proc/<pid>/stat flags: the process is past the point of no return
_held_fds: set[int] = set()


def _close_in_forked_child() -> None:
    # A process forked by the holder (a DataLoader worker) shares the lock's open file; the lock would
    # outlive rank 0 for as long as the child lingers (seconds, until it notices its parent is gone).
    for fd in _held_fds:
        os.close(fd)
    _held_fds.clear()


os.register_at_fork(after_in_child=_close_in_forked_child)


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
            _flock(fd, fcntl.LOCK_EX)
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
        _held_fds.add(fd)

    def check_free(self) -> None:
        """Refuse now if another live run holds the lock (without taking it or creating anything)."""
        if not self.path.exists():
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            _flock(fd, fcntl.LOCK_SH)
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
        _held_fds.discard(self._fd)
        os.close(self._fd)  # closing drops the flock
        self._fd = None
        if remove_if_created and self._created_file:
            self.path.unlink(missing_ok=True)
            if self._created_dir and not any(self.path.parent.iterdir()):
                self.path.parent.rmdir()


def _flock(fd: int, operation: int) -> None:
    """flock without blocking on a live holder; while the holder is on this host and dying, wait (up to
    RELEASE_WAIT_S) for the kernel to release its lock. BlockingIOError when a live run holds it."""
    deadline = time.monotonic() + RELEASE_WAIT_S
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline or not _holder_is_dying(fd):
                raise
            time.sleep(0.02)


def _holder_is_dying(fd: int) -> bool:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        pid, host = int(info["pid"]), info["host"]
    except (ValueError, KeyError, TypeError, OSError):
        return False
    if host != socket.gethostname() or not os.path.isdir("/proc/self"):
        return False  # another machine's run, or no /proc to ask: a lock held is a run alive
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True  # gone: what still holds the lock are its last threads
    except (OSError, IndexError):
        return False
    pending = 0
    for line in status.splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")):
            pending |= int(line.split()[1], 16)
    state, flags = stat[0], int(stat[6])
    return state in ("Z", "X") or bool(flags & _PF_EXITING) or bool(pending & 1 << (signal.SIGKILL - 1))


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"pid {info['pid']} on {info['host']}, since {info['since']}"
    except (ValueError, KeyError, OSError):
        return "holder unknown"
