"""Checkpoints written while training goes on (`checkpoint.async`).

Within the step, `BackgroundWriter.stage` copies this rank's tensors into host memory (pinned on a GPU,
the same buffers reused from one checkpoint to the next) — a copy, since training changes the live
tensors in place — and `write` hands that copy to `torch.distributed.checkpoint.async_save`, which
writes it from a thread of its own. The small files (trainer.json, each rank's RNG states) are written
by the Checkpointer before: they are taken from the live objects and are quick.

DCP's collectives (and the sealing after them, checkpoint/pending.py) run on a gloo process group of
their own, created once: on the group training uses they would interleave with the step's collectives
from another thread (gloo aborts with "collective mismatch"), and under nccl the write needs a CPU group.
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import AsyncStager

__all__ = ["BackgroundWriter"]


class BackgroundWriter:
    """The process group and host buffers of a run's background writes: one checkpoint at a time."""

    def __init__(self, on_gpu: bool):
        self.on_gpu = on_gpu
        self._group: Any = None
        self._stager: Any = None

    @property
    def group(self) -> Any:
        """The checkpoints' own gloo group (None without a process group): created at the first background
        save, which every rank makes together."""
        if self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        return self._group

    def stage(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """A copy of `tensors` in host memory, complete when this returns (the step may change them next)."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self._stager is None:
            # Staged synchronously (use_async_staging off). On a GPU into pinned memory, the copies issued
            # without blocking and waited for together. The buffers are kept, refilled by the next checkpoint.
            options = StagingOptions(
                use_pinned_memory=self.on_gpu,
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=self.on_gpu,
            )
            self._stager = DefaultStager(options)
        return self._stager.stage(tensors)

    def write(self, staged: dict[str, Any], folder: Path, no_dist: bool) -> Future[Any]:
        """Write `staged` (from `stage`) into `folder` with DCP's `async_save`, in its thread (every rank
        calls it). The future is done when this rank's files are written (DCP's metadata too)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        if no_dist:
            # DCP says it "assumes" one process, from its writing thread: for one process that is exactly right.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        future = dcp.async_save(
            staged,
            storage_writer=FileSystemWriter(folder),
            process_group=self.group,
            async_stager=_AlreadyStaged(),
            no_dist=no_dist,
        )
        assert isinstance(future, Future)  # staged already: the write's future alone
        return future

    def close(self) -> None:
        """Let go of the host buffers (the run's last checkpoint is sealed)."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None


class _AlreadyStaged(AsyncStager):
    """`stage` has copied the tensors (every rank agreeing that it could) before the write begins."""

    _synchronize_after_execute = False

    def stage(self, state_dict: Any) -> Any:
        return state_dict

    def synchronize_staging(self) -> None:
        return None

    def close(self) -> None:
        return None


def on_gpu(module: torch.nn.Module) -> bool:
    return next(module.parameters(), torch.empty(0)).device.type == "cuda"
