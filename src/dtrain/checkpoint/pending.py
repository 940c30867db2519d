"""A checkpoint being written: the seam between writing its files and sealing them.

`Checkpointer.start_save` stages the parts, starts the write and hands back a `PendingCheckpoint`;
`wait()` (a collective) seals the folder — manifest, rename, prune — once the write has completed on
every rank, or removes it and raises on every rank. Today the write completes before `start_save`
returns. An asynchronous one (`dcp.async_save`, on a process group of its own: on the default gloo
group it aborts) would hand its future here instead, and the integrity model stays as it is: nothing is
sealed before every rank's files are written.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from dtrain.checkpoint.store import Checkpoint


def completed(write: Callable[[], dict[str, Any]]) -> Future[dict[str, Any]]:
    """`write()` run now, as the future an asynchronous write would give: its marker metadata, or the
    exception it raised (DCP's CheckpointException is a BaseException)."""
    from torch.distributed.checkpoint.api import CheckpointException

    future: Future[dict[str, Any]] = Future()
    try:
        future.set_result(write())
    except (Exception, CheckpointException) as exc:
        future.set_exception(exc)
    return future


class PendingCheckpoint:
    """Checkpoint `step`, written by `write` and sealed by `seal(write)` in `wait()`, once."""

    def __init__(self, step: int, write: Future[dict[str, Any]], seal: Callable[[Future[dict[str, Any]]], Checkpoint]):
        self.step = step
        self._write = write
        self._seal = seal
        self._sealed: Checkpoint | None = None
        self._failed: BaseException | None = None

    @property
    def done(self) -> bool:
        """Whether this rank's files are written (the checkpoint is sealed only by `wait()`)."""
        return self._write.done()

    def wait(self) -> Checkpoint:
        """The sealed checkpoint, once every rank's write completed (a collective: every rank calls it);
        a CheckpointError on every rank when any rank's write failed."""
        if self._failed is not None:
            raise self._failed
        if self._sealed is None:
            try:
                self._sealed = self._seal(self._write)
            except BaseException as exc:
                self._failed = exc
                raise
        return self._sealed
