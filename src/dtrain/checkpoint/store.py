"""Where checkpoints live and which one counts.

    <run.dir>/checkpoints/step-<N>/            a complete checkpoint (holds COMPLETE.json)
    <run.dir>/checkpoints/.partial-step-<N>/   one being written; never chosen, removed on the next start

A checkpoint is written under its partial name, every file fsynced, then its marker — a manifest of
every file's size and CRC-32 — is written last and the folder renamed into place. A folder without the
marker is never chosen; one whose files do not match the marker is refused with the file named.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtrain.checkpoint import formats
from dtrain.checkpoint.manifest import MARKER, manifest, verify
from dtrain.errors import DtrainError
from dtrain.files import atomic_write_text, fsync_dir

PARTIAL_PREFIX = ".partial-"
_STEP_DIR = re.compile(r"step-(\d+)")


class CheckpointError(DtrainError):
    """A checkpoint that cannot be used as it is."""


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    def meta(self) -> dict[str, Any]:
        return json.loads((self.path / MARKER).read_text())


class CheckpointStore:
    def __init__(self, run_dir: Path):
        self.root = Path(run_dir) / "checkpoints"

    def complete(self) -> list[Checkpoint]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            match = _STEP_DIR.fullmatch(path.name)
            # Only dtrain's own spelling (step-15, not step-015): the name is how a step finds its folder.
            if match and path.name == f"step-{int(match.group(1))}" and (path / MARKER).is_file():
                found.append(Checkpoint(int(match.group(1)), path))
        return sorted(found, key=lambda c: c.step)

    def newest(self) -> Checkpoint | None:
        complete = self.complete()
        return complete[-1] if complete else None

    def partial_path(self, step: int) -> Path:
        return self.root / f"{PARTIAL_PREFIX}step-{step}"

    def remove_partials(self) -> list[Path]:
        """Delete what interrupted writes left behind (call only while holding the run-dir lock)."""
        removed = []
        if self.root.is_dir():
            for path in self.root.iterdir():
                if path.name.startswith(PARTIAL_PREFIX):
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
        return removed

    def begin(self, step: int) -> Path:
        """A fresh, empty folder to write checkpoint `step` into."""
        path = self.partial_path(step)
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def commit(self, step: int, meta: dict[str, Any], marker: str | None = None) -> Checkpoint:
        """Seal the partial folder of `step` with its manifest and move it into place. `marker`: the
        COMPLETE.json to seal it with, already written on the store (whose manifest may list files that
        other nodes wrote, not here)."""
        partial = self.partial_path(step)
        atomic_write_text(partial / MARKER, marker or marker_text(meta, manifest(partial)))
        final = self.root / f"step-{step}"
        if final.exists():  # the same step written again (a rerun after a crash): replace it whole
            stale = self.root / f"{PARTIAL_PREFIX}replaced-step-{step}"
            shutil.rmtree(stale, ignore_errors=True)
            final.rename(stale)
            partial.rename(final)
            shutil.rmtree(stale, ignore_errors=True)
        else:
            partial.rename(final)
        fsync_dir(self.root)
        return Checkpoint(step, final)

    def abandon(self, step: int) -> None:
        shutil.rmtree(self.partial_path(step), ignore_errors=True)

    def prune(self, keep: int, spare: int | None = None) -> list[Checkpoint]:
        """Delete the oldest complete checkpoints beyond the newest `keep` (never the newest one), sparing
        step `spare` (checkpoint.keep_best's) besides them."""
        complete = [checkpoint for checkpoint in self.complete() if checkpoint.step != spare]
        doomed = complete[: max(0, len(complete) - max(keep, 1))]
        for checkpoint in doomed:
            # Out of the way first, by a rename: a deletion cut short (a kill while a checkpoint written in
            # the background prunes) leaves a partial folder the next start removes, never a step-N without
            # its marker that nothing would ever remove.
            doomed_path = self.root / f"{PARTIAL_PREFIX}pruned-{checkpoint.name}"
            shutil.rmtree(doomed_path, ignore_errors=True)
            checkpoint.path.rename(doomed_path)
            shutil.rmtree(doomed_path, ignore_errors=True)
        return doomed

    def check_intact(self, checkpoint: Checkpoint) -> dict[str, Any]:
        """The checkpoint's marker, after checking every file against it."""
        try:
            meta = checkpoint.meta()
        except (OSError, ValueError) as exc:
            raise CheckpointError(
                f"{checkpoint.path / MARKER} cannot be read ({exc}); {self._instead(checkpoint)}"
            ) from None
        if isinstance(meta, dict) and formats.newer(meta.get("format")):
            raise CheckpointError(formats.newer_refusal(checkpoint.name, meta["format"]))
        problem = marker_problem(meta, checkpoint.step)
        if problem:
            raise CheckpointError(
                f"{checkpoint.path / MARKER} is not a marker dtrain wrote ({problem}); {self._instead(checkpoint)}"
            )
        problem = verify(checkpoint.path, meta["files"])
        if problem:
            raise CheckpointError(f"checkpoint {checkpoint.name} is damaged: {problem}; {self._instead(checkpoint)}")
        return meta

    def _instead(self, damaged: Checkpoint) -> str:
        """What a run does without the `damaged` checkpoint: resume from the one before, or start over."""
        earlier = [c.name for c in self.complete() if c.step < damaged.step]
        if earlier:
            return f"delete {damaged.path} to resume from {earlier[-1]}"
        return f"delete {damaged.path} and rerun with run.overwrite=true to start over"


def marker_text(meta: dict[str, Any], files: dict[str, dict[str, int]]) -> str:
    """A COMPLETE.json: the checkpoint's metadata and the manifest of its files."""
    return json.dumps({**meta, "files": files}, indent=1)


def marker_problem(meta: Any, step: int) -> str | None:
    """What is wrong with a COMPLETE.json's shape (None: nothing): an object naming its step and
    listing files, each with its size and checksum."""
    if not isinstance(meta, dict):
        return "not a JSON object"
    if meta.get("step") != step or isinstance(meta.get("step"), bool):
        return f"it says step {meta.get('step')!r}"
    stated = "format" in meta  # formats 1 and 2 carry no number
    if stated and formats.stated_problem(meta["format"]):
        return formats.stated_problem(meta["format"])
    if stated and "samples_per_step" not in meta:
        return "no samples_per_step"
    for key in ("world_size", "data_ranks"):
        world = meta.get(key, 1)
        if not isinstance(world, int) or isinstance(world, bool) or world < 1:
            return f"{key} {world!r}"
    per_rank = meta.get("samples_per_step", 1)
    if not isinstance(per_rank, int) or isinstance(per_rank, bool) or per_rank < 1:
        return f"samples_per_step {per_rank!r}"
    files = meta.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(entry, dict)
        and all(isinstance(entry.get(k), int) and not isinstance(entry.get(k), bool) for k in ("bytes", "crc32"))
        for entry in files.values()
    ):
        return "its file list is malformed"
    return None


def describe_failure(exc: BaseException) -> str:
    """The root cause of a (possibly DCP-wrapped) failure, in one line."""
    failures = getattr(exc, "failures", None)  # CheckpointException: {rank: (exception, stack)}
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        exc = inner[0] if isinstance(inner, tuple) else inner
    while exc.__cause__ is not None:
        exc = exc.__cause__
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}" + (f" ({exc.filename})" if exc.filename else "")
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__


def check_intact(checkpoint: Checkpoint, store: CheckpointStore) -> dict[str, Any]:
    """The marker of the checkpoint a run resumes from, every file checked against it: run.dir's own, or
    --resume-from's, whose refusal never advises deleting it (that advice is for a run.dir's own)."""
    if checkpoint.path.parent.resolve() == store.root.resolve():
        return store.check_intact(checkpoint)
    try:
        return CheckpointStore(checkpoint.path.parent.parent).check_intact(checkpoint)
    except CheckpointError as exc:
        raise CheckpointError(
            f"--resume-from {checkpoint.path}: {str(exc).split('; ')[0]}; give another checkpoint"
        ) from None
