"""Files that are whole or absent: atomic writes (with the user's normal file mode) and fsync of files and
folders. Used by every stage that writes into run.dir (data, checkpoint, rundir, train)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` so that readers see the old file or the whole new one, never a part."""
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def atomic_write(path: Path, write: Callable[[str], object]) -> None:
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


def user_file_mode(folder: bool = False) -> int:
    """The mode a program's new file (0666) or folder (0777) gets under the user's umask."""
    mask = os.umask(0)  # the only way to read it is to set it: set it straight back
    os.umask(mask)
    return (0o777 if folder else 0o666) & ~mask
