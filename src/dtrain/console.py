"""The console may go away while the run goes on.

A job started as `dtrain run ... | tee log` and stopped by a scheduler (SIGTERM to the job's process
group) loses its reader first: `tee` dies at once, and the next line a worker prints would raise
BrokenPipeError — in the middle of the step the SIGTERM asked to finish with a checkpoint, so the run
ended with nothing saved. Printing is never worth the run: once the reader is gone, what follows goes
to /dev/null (at the file descriptor, so torch's own C++ writes and the interpreter's last flush too).
No torch here: installed first thing by the command line.
"""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO


class _Unbreakable:
    """A text stream whose writes outlive its reader."""

    def __init__(self, stream: TextIO):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()

    def _to_devnull(self) -> None:
        # What the stream still buffers would fail again at the next flush: it goes to /dev/null too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())
        finally:
            os.close(devnull)
        try:
            self._stream.flush()
        except OSError:
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def outlive_the_reader() -> None:
    """Make sys.stdout and sys.stderr carry on (into /dev/null) once whoever reads them is gone."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None or isinstance(stream, _Unbreakable):
            continue
        try:
            stream.fileno()
        except (OSError, ValueError, AttributeError):  # not a file (a test's capture): leave it
            continue
        setattr(sys, name, _Unbreakable(stream))
