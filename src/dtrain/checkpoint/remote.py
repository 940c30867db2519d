"""Checkpoints on an object store: `<run.dir URL>/checkpoints/step-<N>/`, next to CheckpointStore's local
folders (the same split as data.shard_store's local and remote readers).

A store has no rename, so a checkpoint cannot appear whole at once. Instead its COMPLETE.json (the same
manifest of sizes and CRC-32s a local checkpoint is sealed with) is written last, after every other
object of the checkpoint is on the store with the size its manifest says, and only a prefix holding
one counts: readers take the complete steps from one recursive listing and never look inside the
others. Removal runs the other way: COMPLETE.json goes first, so a deletion cut short leaves a prefix
that no reader takes and the next start removes (only the run holding run.dir's lease cleans).

Sealing is the Checkpointer's (checkpoint/__init__.py): each node sends the files its ranks wrote
(`put`: on several nodes without a shared file system each node's staging folder holds only its own
ranks' files), the main rank seals the prefix with the manifest covering them all (`seal`), and only then
the local folder is renamed into place — so a checkpoint exists locally only once the store holds it
whole. Objects come down into a local folder that is checked against the manifest again before anything
is loaded from it.
"""

from __future__ import annotations

import json
import re
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path

from dtrain import objstore
from dtrain.checkpoint.manifest import MARKER
from dtrain.checkpoint.store import Checkpoint, CheckpointError, CheckpointStore

_STEP = re.compile(r"step-(\d+)")
KEY = "run.dir"


class RemoteCheckpointStore:
    def __init__(self, run_url: str):
        self.url = objstore.join(run_url, "checkpoints")
        # Whether this process may still write the store's checkpoints (rank 0: while it holds run.dir's lease).
        self.allowed: Callable[[], bool] = lambda: True

    def _prefixes(self) -> dict[int, dict[str, int]]:
        """step -> {object name under step-N/: size}, from one listing of checkpoints/."""
        found: dict[int, dict[str, int]] = {}
        for name, size in objstore.listing(self.url, KEY).items():
            folder, _, rest = name.partition("/")
            match = _STEP.fullmatch(folder)
            if match and folder == f"step-{int(match.group(1))}" and rest:
                found.setdefault(int(match.group(1)), {})[rest] = size
        return found

    def complete(self) -> list[int]:
        """The steps whose prefix holds COMPLETE.json, oldest first."""
        return sorted(step for step, objects in self._prefixes().items() if MARKER in objects)

    def newest(self) -> int | None:
        complete = self.complete()
        return complete[-1] if complete else None

    def remove_partials(self) -> list[int]:
        """Delete every prefix without COMPLETE.json (a write or a deletion cut short); only the holder
        of run.dir's lease may (a live writer's prefix has no COMPLETE.json yet either)."""
        partial = {step: objects for step, objects in self._prefixes().items() if MARKER not in objects}
        for step, objects in sorted(partial.items()):
            objstore.remove([self._object(step, name) for name in sorted(objects)], KEY)
        return sorted(partial)

    def unseal(self, step: int) -> None:
        """Remove the prefix of `step`, COMPLETE.json first: before checkpoint `step` is written again (a
        rerun after a crash), and after a write that failed."""
        objects = self._prefixes().get(step, {})
        names = ([MARKER] if MARKER in objects else []) + sorted(name for name in objects if name != MARKER)
        objstore.remove([self._object(step, name) for name in names], KEY)

    def put(self, step: int, folder: Path) -> dict[str, dict[str, int]]:
        """Send every file under `folder` (a checkpoint being written, but for its COMPLETE.json) to the
        prefix of `step`: the manifest entries (size, CRC-32) of what was sent, computed from the bytes sent."""
        sent: dict[str, dict[str, int]] = {}
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            name = path.relative_to(folder).as_posix()
            if name == MARKER:
                continue
            data = path.read_bytes()
            objstore.write_bytes(self._object(step, name), data, KEY)
            sent[name] = {"bytes": len(data), "crc32": zlib.crc32(data)}
        return sent

    def seal(self, step: int, marker: str) -> None:
        """Write COMPLETE.json (`marker`, its manifest listing every object) under `step`, once the listing
        shows every object with its manifest's size: from then on the checkpoint counts."""
        files: dict[str, dict[str, int]] = json.loads(marker)["files"]
        there = self._prefixes().get(step, {})
        short = [name for name, want in files.items() if there.get(name) != want["bytes"]]
        if short:
            raise CheckpointError(
                f"checkpoint step-{step} did not reach {self.url} whole ({short[0]}: "
                f"{there.get(short[0], 'no')} bytes there, {files[short[0]]['bytes']} written); it stays unsealed there"
            )
        objstore.write_bytes(self._object(step, MARKER), marker.encode(), KEY)

    def upload(self, checkpoint: Checkpoint) -> None:
        """Put a sealed local checkpoint on the store: every object, then (once the listing shows each
        with its manifest's size) COMPLETE.json. The same step already there first loses its
        COMPLETE.json, so no reader takes it half replaced."""
        meta = json.loads((checkpoint.path / MARKER).read_text())
        files: dict[str, dict[str, int]] = meta["files"]
        objstore.remove([self._object(checkpoint.step, MARKER)], KEY)
        for name in sorted(files):
            objstore.write_bytes(self._object(checkpoint.step, name), (checkpoint.path / name).read_bytes(), KEY)
        self.seal(checkpoint.step, (checkpoint.path / MARKER).read_text())

    def fetch(self, step: int, run_dir: Path) -> None:
        """Make `run_dir`'s local checkpoint `step` the store's, whole: nothing to do when it has the
        store's COMPLETE.json and every file it lists at its size (its CRCs are checked before a resume);
        else it comes down (`download`). On several nodes each node's copy holds only its own ranks' files
        until then."""
        marker, _ = objstore.read_bytes(self._object(step, MARKER), KEY)
        if not whole_copy(run_dir / "checkpoints" / f"step-{step}", marker):
            self.download(step, run_dir)

    def download(self, step: int, run_dir: Path) -> Checkpoint:
        """Checkpoint `step` into `run_dir/checkpoints/step-<step>` (a local folder), checked against its
        manifest before it is returned."""
        local = CheckpointStore(run_dir)
        folder = local.begin(step)  # an unsealed name until every object is down
        marker, _ = objstore.read_bytes(self._object(step, MARKER), KEY)
        files = json.loads(marker)["files"]
        for name in sorted(files):
            target = folder / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(objstore.read_bytes(self._object(step, name), KEY)[0])
        (folder / MARKER).write_bytes(marker)
        final = local.root / f"step-{step}"
        shutil.rmtree(final, ignore_errors=True)  # a stale local copy: the store's is the checkpoint
        folder.rename(final)
        checkpoint = Checkpoint(step, final)
        try:
            local.check_intact(checkpoint)
        except CheckpointError as exc:
            raise CheckpointError(f"{exc} (as read from {self._object(step, '')})") from None
        return checkpoint

    def prune(self, keep: int, everything: bool = False, spare: int | None = None) -> list[int]:
        """Delete the oldest complete checkpoints beyond the newest `keep` (never the newest, unless
        `everything`: a run told to start afresh; never step `spare`, checkpoint.keep_best's, unless
        `everything`), each COMPLETE.json first."""
        prefixes = self._prefixes()
        complete = sorted(
            step for step, objects in prefixes.items() if MARKER in objects and (everything or step != spare)
        )
        doomed = complete if everything else complete[: max(0, len(complete) - max(keep, 1))]
        for step in doomed:
            others = sorted(name for name in prefixes[step] if name != MARKER)
            objstore.remove([self._object(step, name) for name in (MARKER, *others)], KEY)
        return doomed

    def _object(self, step: int, name: str) -> str:
        return f"{self.url}/step-{step}/{name}"


def whole_copy(folder: Path, marker: bytes) -> bool:
    """Whether the local checkpoint `folder` is sealed with `marker` and holds every file it lists, at its
    size (the store's copy, as far as can be told without reading every byte)."""
    try:
        if (folder / MARKER).read_bytes() != marker:
            return False
        files = json.loads(marker)["files"]
        return all(
            (folder / name).is_file() and (folder / name).stat().st_size == f["bytes"] for name, f in files.items()
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False
