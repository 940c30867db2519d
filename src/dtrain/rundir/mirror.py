"""run.dir on an object store (`run.dir = s3://bucket/prefix`), through a local staging folder.

Every stage keeps writing a local folder as it does today (memory maps, appends to metrics.jsonl,
TensorBoard's event files, DCP's checkpoint writer: none of them can write an object store in place),
and the store is kept equal to it: the staging folder is `staging_for(url)`, filled from the store at the
start (`pull`: the run's outputs and its newest complete checkpoint, nothing the store does not hold),
and sent back (`push`) by the run holding run.dir's lease — after each checkpoint, every third of the
lease's term, and at the end. The store is the run.dir: a run on another machine resumes from it.

Checkpoints are not sent from here: the Checkpointer seals each on the store before its local folder
(checkpoint/on_store.py: every node's files, then COMPLETE.json), so that a job on several nodes, each
with its own staging folder, reaches the store whole. The other outputs (rank 0's: metrics, TensorBoard,
final weights) go up from rank 0's node as whole objects (one PUT each, atomic), each when it changed.
Every node's launcher pulls (`fetch_for_launcher`), which changes only its own staging folder; only the
run holding the lease ever deletes on the store.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import threading
from pathlib import Path

from dtrain import objstore
from dtrain.checkpoint.best import BEST_FILE
from dtrain.checkpoint.manifest import MARKER
from dtrain.checkpoint.remote import RemoteCheckpointStore
from dtrain.checkpoint.store import CheckpointStore
from dtrain.rundir import lease

KEY = "run.dir"


def staging_for(url: str) -> Path:
    """The local folder a run.dir URL is staged in: under the user's cache, named after the URL (readable,
    plus a hash so that two URLs never share one)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dtrain" / "run-dirs"
    shown = re.sub(r"[^A-Za-z0-9._-]+", "-", objstore.without_credentials(url).split("://", 1)[-1]).strip("-")
    return base / f"{shown[:80]}-{hashlib.sha256(url.encode()).hexdigest()[:10]}"


def local_dir(run_dir: str | Path) -> Path:
    """Where the run's files are written on this machine: run.dir itself, or a URL's staging folder."""
    return staging_for(str(run_dir)) if objstore.is_url(run_dir) else Path(run_dir)


class Mirror:
    """Keeps the store at `url` equal to the staging folder (see the module's docstring)."""

    def __init__(self, url: str, staging: Path, keep: int):
        self.url, self.staging, self.keep = url, staging, keep
        self.checkpoints = RemoteCheckpointStore(url)
        self._sent: dict[str, tuple[int, int]] = {}  # name -> (size, mtime_ns) of what the store holds
        self._sealed: dict[int, bytes] = {}  # step -> the COMPLETE.json the store holds for it
        self._lock = threading.Lock()  # push() runs from the lease's thread too

    def pull(self) -> None:
        """Make the staging folder hold what the store holds: its outputs, and its newest complete
        checkpoint; whatever the store does not hold leaves the staging folder."""
        with self._lock:
            remote = objstore.listing(self.url, KEY)
            files = {n: s for n, s in remote.items() if not _in_a_checkpoint(n) and n != lease.NAME}
            self.staging.mkdir(parents=True, exist_ok=True)
            for path in sorted(self.staging.rglob("*")):
                name = path.relative_to(self.staging).as_posix()
                if path.is_file() and not _in_a_checkpoint(name) and name not in files:
                    path.unlink()
            self._sent = {}
            for name in sorted(files):  # every one, whatever is here: a file of the same size may differ
                target = self.staging / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(objstore.read_bytes(objstore.join(self.url, name), KEY)[0])
                self._sent[name] = _stamp(target)
            self._pull_checkpoints()

    def _pull_checkpoints(self) -> None:
        complete = self.checkpoints.complete()
        self._sealed = {
            step: objstore.read_bytes(f"{self.checkpoints.url}/step-{step}/{MARKER}", KEY)[0] for step in complete
        }
        local = CheckpointStore(self.staging)
        local.remove_partials()
        for checkpoint in local.complete():  # a local checkpoint the store does not hold (as it is) is gone
            if self._sealed.get(checkpoint.step) != (checkpoint.path / MARKER).read_bytes():
                shutil.rmtree(checkpoint.path)
        if complete:  # the newest, whole (a node's own copy holds only its ranks' files)
            self.checkpoints.fetch(complete[-1], self.staging)

    def push(self, checkpoints: bool = True) -> None:
        """Send what changed in the staging folder to the store, and delete there what left it."""
        with self._lock:
            for path in sorted(self.staging.rglob("*")):
                name = path.relative_to(self.staging).as_posix()
                if not path.is_file() or _in_a_checkpoint(name) or _skipped(name):
                    continue
                stamp = _stamp(path)
                if self._sent.get(name) != stamp:
                    objstore.write_bytes(objstore.join(self.url, name), path.read_bytes(), KEY)
                    self._sent[name] = stamp
            gone = [name for name in self._sent if not (self.staging / name).is_file()]
            objstore.remove([objstore.join(self.url, name) for name in gone], KEY)
            for name in gone:
                del self._sent[name]
            if checkpoints:
                self._push_checkpoints()

    def _push_checkpoints(self) -> None:
        # Sealed on the store by the Checkpointer, pruned there too; what is left here: a run told to
        # start afresh (run.overwrite) deleted the local checkpoints, so the store's go as well.
        if self._sealed and not CheckpointStore(self.staging).complete():
            self.checkpoints.prune(keep=0, everything=True)
            self._sealed = {}


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def _in_a_checkpoint(name: str) -> bool:
    """A file of a checkpoint folder (sealed on the store by the Checkpointer, never mirrored from here).
    checkpoints/best.json, checkpoint.keep_best's choice, is an output like metrics.jsonl: mirrored."""
    return name.startswith("checkpoints/") and name != f"checkpoints/{BEST_FILE}"


def _skipped(name: str) -> bool:
    """Local only: the flock file and atomic writes' temporary files."""
    base = name.rsplit("/", 1)[-1]
    return name == ".lock" or (base.startswith(".") and base.endswith(".tmp"))


def fetch_for_launcher(url: str, keep: int) -> Path:
    """What the launcher checks of a run.dir URL before any worker starts, in one line each: a store that
    answers with this bucket and these credentials, no live run holding the lease. Then the staging
    folder is filled from the store, so that the launcher's checks of run.dir (its outputs, its
    checkpoints) read what the store holds — on every node of a job, each into its own staging folder."""
    lease.RunDirLease(url).check_free()
    staging = staging_for(url)
    Mirror(url, staging, keep).pull()
    return staging
