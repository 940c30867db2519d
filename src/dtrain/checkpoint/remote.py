"""Checkpoints on an object store: `<run.dir URL>/checkpoints/step-<N>/`, next to CheckpointStore's local
folders (the same split as data.shard_store's local and remote readers).

A store has no rename, so a checkpoint cannot appear whole at once. Instead its COMPLETE.json (the same
manifest of sizes and CRC-32s a local checkpoint is sealed with) is written last, after every other
object of the checkpoint is on the store with the size its manifest says, and only a prefix holding
one counts: readers take the complete steps from one recursive listing and never look inside the
others. Removal runs the other way: COMPLETE.json goes first, so a deletion cut short leaves a prefix
that no reader takes and the next start removes (only the run holding run.dir's lease cleans).

Objects go up from a local checkpoint that is already sealed (its manifest checked), and come down into
a local folder that is checked against the manifest again before anything is loaded from it.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from dtrain import objstore
from dtrain.checkpoint.manifest import MARKER
from dtrain.checkpoint.store import Checkpoint, CheckpointError, CheckpointStore

_STEP = re.compile(r"step-(\d+)")
KEY = "run.dir"


class RemoteCheckpointStore:
    def __init__(self, run_url: str):
        self.url = objstore.join(run_url, "checkpoints")

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

    def upload(self, checkpoint: Checkpoint) -> None:
        """Put a sealed local checkpoint on the store: every object, then (once the listing shows each
        with its manifest's size) COMPLETE.json. The same step already there (a rerun after a crash)
        first loses its COMPLETE.json, so no reader takes it half replaced."""
        meta = json.loads((checkpoint.path / MARKER).read_text())
        files: dict[str, dict[str, int]] = meta["files"]
        objstore.remove([self._object(checkpoint.step, MARKER)], KEY)
        for name in sorted(files):
            objstore.write_bytes(self._object(checkpoint.step, name), (checkpoint.path / name).read_bytes(), KEY)
        there = self._prefixes().get(checkpoint.step, {})
        short = [name for name, want in files.items() if there.get(name) != want["bytes"]]
        if short:
            raise CheckpointError(
                f"checkpoint {checkpoint.name} did not reach {self.url} whole ({short[0]}: "
                f"{there.get(short[0], 'no')} bytes there, {files[short[0]]['bytes']} written); it stays unsealed there"
            )
        objstore.write_bytes(self._object(checkpoint.step, MARKER), (checkpoint.path / MARKER).read_bytes(), KEY)

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

    def prune(self, keep: int, everything: bool = False) -> list[int]:
        """Delete the oldest complete checkpoints beyond the newest `keep` (never the newest, unless
        `everything`: a run told to start afresh), each COMPLETE.json first."""
        prefixes = self._prefixes()
        complete = sorted(step for step, objects in prefixes.items() if MARKER in objects)
        doomed = complete if everything else complete[: max(0, len(complete) - max(keep, 1))]
        for step in doomed:
            others = sorted(name for name in prefixes[step] if name != MARKER)
            objstore.remove([self._object(step, name) for name in (MARKER, *others)], KEY)
        return doomed

    def _object(self, step: int, name: str) -> str:
        return f"{self.url}/step-{step}/{name}"
