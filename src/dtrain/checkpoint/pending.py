"""A checkpoint being written: the seam between writing its files and sealing them.

`Checkpointer.start_save` stages the parts, starts the write and hands back a `PendingCheckpoint`;
`wait()` (a collective) seals the folder — manifest, rename, prune — once the write has completed on
every rank, or removes it and raises on every rank. A synchronous write completes before `start_save`
returns and `wait()` seals it.

A background write (`checkpoint.async`, checkpoint/background.py) is sealed by the writing thread itself,
the moment its write completes, with the sealing's collectives on the checkpoints' own process group.
Why there, and not at a step of training's choosing: every rank's writing thread reaches the sealing
after the same DCP collectives, so the ranks meet there with nothing to agree on beforehand, and the
checkpoint is sealed as soon as it can be — never left written but unsealed until a later step (a crash
then would lose it), never costing the step a collective. `wait()` then only waits for that thread. The
integrity model is the synchronous one: nothing is sealed before every rank's files are written, and a
process killed mid-write leaves a `.partial-step-N` folder that the next start removes.
"""

from __future__ import annotations

import time
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
    """Checkpoint `step`, written by `write` and sealed by `seal(write)` once: in `wait()`, or (`background`)
    by the thread that completes `write`. `blocked_s`: how long training waited for it (the caller's
    measure); `write_s`: from the start of its write to its seal."""

    def __init__(
        self,
        step: int,
        write: Future[dict[str, Any]],
        seal: Callable[[Future[dict[str, Any]]], Checkpoint],
        background: bool = False,
    ):
        self.step = step
        self.background = background
        self.blocked_s = 0.0
        self.write_s = 0.0
        self._began = time.perf_counter()
        self._write = write
        self._seal = seal
        self._sealed: Future[Checkpoint] | None = None
        if background:
            self._sealed = Future()
            write.add_done_callback(self._seal_now)  # runs in the writing thread (or here, if written already)

    @property
    def done(self) -> bool:
        """Whether `wait()` would return without waiting: a background checkpoint sealed (or failed); a
        synchronous one's files written on this rank (it is sealed by `wait()`)."""
        return (self._sealed or self._write).done()

    @property
    def sealed(self) -> bool:
        """Whether it is sealed (False while being written, or failed)."""
        return self._sealed is not None and self._sealed.done() and self._sealed.exception() is None

    def _seal_now(self, write: Future[dict[str, Any]]) -> None:
        sealed = self._sealed = self._sealed or Future()
        try:
            checkpoint = self._seal(write)
        except BaseException as exc:  # raised by wait(), on the training thread
            self.write_s = time.perf_counter() - self._began
            sealed.set_exception(exc)
            return
        self.write_s = time.perf_counter() - self._began  # before the result: `done` means all is set
        sealed.set_result(checkpoint)

    def wait(self) -> Checkpoint:
        """The sealed checkpoint, once every rank's write completed (a collective: every rank calls it);
        a CheckpointError on every rank when any rank's write failed."""
        if self._sealed is None:
            self._seal_now(self._write)
        assert self._sealed is not None
        return self._sealed.result()
