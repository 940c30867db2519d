"""Sealing a checkpoint on an object store (`run.dir = s3://…`), on one node or several.

Each process writes its checkpoint files into its node's local staging folder (checkpoint/store.py), and
on several nodes without a shared file system each node's folder holds only its own ranks' files. So a
checkpoint is sealed on the store, not in a folder:

1. every node's leader (its lowest rank: one per staging folder) sends the files its node wrote to the
   step's prefix, with their sizes and CRC-32s computed from the bytes it sent; these are gathered;
2. the main rank writes COMPLETE.json on the store, its manifest covering every node's files (the store's
   listing showing each first) — from this moment the checkpoint exists;
3. only then each leader seals its local folder with that same COMPLETE.json (the rename into place).

A kill before 2 leaves a prefix without COMPLETE.json, which no reader takes and the next start removes,
and local partial folders; a kill between 2 and 3 leaves a complete checkpoint on the store, which the
next start fetches. Never a local checkpoint that the store lacks: the store is the run.dir. Before a
resume every leader fetches the checkpoint its node lacks (`localize`), so every node has it whole.
"""

from __future__ import annotations

import socket
from typing import Any

from dtrain.checkpoint.remote import RemoteCheckpointStore
from dtrain.checkpoint.store import CheckpointStore, describe_failure, marker_text
from dtrain.distributed import every_rank_raises, gather_objects
from dtrain.errors import DtrainError

Files = dict[str, dict[str, int]]


class StoreSealing:
    """The node-by-node part of a Checkpointer whose run.dir is on a store. Methods marked collective are
    called on every rank."""

    def __init__(self, remote: RemoteCheckpointStore, store: CheckpointStore, rank: int):
        self.remote, self.store, self.rank = remote, store, rank
        self._leads: bool | None = None
        self._sealed: int | None = None  # the step whose COMPLETE.json this process wrote last

    @property
    def leads_node(self) -> bool:
        """Whether this rank writes its staging folder's files (False until `find_leaders`)."""
        return self._leads is True

    def find_leaders(self) -> None:
        """Which rank leads each staging folder: the lowest of those on one host writing one folder
        (collective, on the default group; once)."""
        if self._leads is None:
            mine = (socket.gethostname(), str(self.store.root.resolve()))
            self._leads = gather_objects(mine).index(mine) == self.rank

    def localize(self, step: int | None) -> None:
        """Every node's copy of checkpoint `step` made whole from the store, and what interrupted writes
        left in a node's folder removed (rank 0's own: by the Checkpointer) (collective)."""
        error = None
        if self.leads_node:
            try:
                if self.rank != 0:
                    self.store.remove_partials()
                if step is not None:
                    self.remote.fetch(step, self.store.root.parent)
            except Exception as exc:  # every rank must hear of it
                error = f"rank {self.rank}: {describe_failure(exc)}"
        every_rank_raises(error)

    def begin(self, step: int) -> None:
        """The store's prefix of `step` emptied (main rank, before any node sends to it)."""
        self.remote.unseal(step)

    def begin_on_nodes(self, step: int) -> None:
        """A fresh partial folder for `step` in every other node's staging folder (collective)."""
        error = None
        if self.leads_node and self.rank != 0:
            try:
                self.store.begin(step)
            except Exception as exc:  # every rank must hear of it
                error = f"rank {self.rank}: {describe_failure(exc)}"
        every_rank_raises(error)

    def send(self, step: int, group: Any = None) -> Files:
        """Every node's files of `step` sent to the store; the manifest of them all, on every rank
        (collective, on `group`)."""
        files: Files = {}
        error = None
        if self.leads_node:
            try:
                files = self.remote.put(step, self.store.partial_path(step))
            except Exception as exc:  # every rank must hear of it
                error = f"rank {self.rank}: {describe_failure(exc)}"
        gathered = gather_objects((files, error), group)
        failed = next((e for _, e in gathered if e is not None), None)
        if failed is not None:
            raise DtrainError(failed)
        merged: Files = {}
        for sent, _ in gathered:  # two leaders of one folder (shared by hosts) send the same files
            merged.update(sent)
        return dict(sorted(merged.items()))

    def seal(self, step: int, meta: dict[str, Any], files: Files) -> str:
        """Write COMPLETE.json on the store (main rank): the checkpoint exists from here on. Its text."""
        if not self.remote.allowed():
            raise DtrainError(f"this run no longer holds run.dir's lease on {self.remote.url}; nothing was sealed")
        marker = marker_text(meta, files)
        self.remote.seal(step, marker)
        self._sealed = step
        return marker

    def seal_on_node(self, step: int, marker: str, keep: int) -> None:
        """After the store's seal, another node's folder sealed with the same COMPLETE.json and pruned. A
        failure here costs nothing: the store holds the checkpoint, and a resume fetches what is missing."""
        if not self.leads_node or self.rank == 0:
            return
        try:
            self.store.commit(step, {}, marker=marker)
            self.store.prune(keep)
        except OSError:
            self.store.abandon(step)

    def unseal_after_failure(self, step: int) -> None:
        """A checkpoint that failed leaves nothing on the store (main rank; best effort: the next start
        removes a prefix without COMPLETE.json anyway). Never once the lease is lost: the store is another
        run's then; nor once it is sealed there (what failed came after: the store's copy is the checkpoint)."""
        if not self.remote.allowed() or self._sealed == step:
            return
        try:
            self.remote.unseal(step)
        except Exception:  # already failing; the next start cleans
            pass

    def prune(self, keep: int, spare: int | None = None) -> None:
        """The store's oldest checkpoints beyond `keep` removed (sparing step `spare`, checkpoint.keep_best's),
        each COMPLETE.json first (main rank)."""
        self.remote.prune(keep, spare=spare)
