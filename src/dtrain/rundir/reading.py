"""Commands that only read a run (`dtrain generate`, `report`, `export`) given a run.dir on an object store.

They read local files (memory maps, DCP's reader, safetensors), so what each needs is copied from the store
into a folder of its own under the user's cache (`~/.cache/dtrain/run-reads/`) — never the staging folder a
live run on this machine writes through (rundir.mirror) — and read there as a local run.dir. Nothing is
written to the store and the lease is not taken: reading a run while it trains is fine, as for a local
run.dir (the lease only says whether one does, for the commands' notes).

A checkpoint is only ever read from a prefix holding COMPLETE.json (as the run itself resumes), checked
against that manifest once down. Files keep the store's modification times, so `generate` tells a newer
checkpoint from the final weights as it does on a local run.dir.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dtrain import objstore
from dtrain.checkpoint.manifest import MARKER
from dtrain.checkpoint.remote import RemoteCheckpointStore
from dtrain.errors import DtrainError
from dtrain.rundir import lease, mirror

KEY = "RUN_DIR"
# What the commands read of a run besides its weights: never its events, traces or trackers' stores.
_DESCRIBES = re.compile(r"config\.toml|model\.json|metrics\.jsonl|tokenizer/[^/]+")
_SEALED = re.compile(r"checkpoints/step-(\d+)/" + re.escape(MARKER))


@dataclass
class Copy:
    url: str
    path: Path  # the local folder to read as the run.dir
    training: bool  # a live run holds the run.dir's lease now


def reads_base() -> Path:
    return mirror.staging_for("x").parent.parent / "run-reads"


def report_folder(url: str) -> Path:
    """Where `dtrain report` of a run.dir URL copies its metrics and writes the report: kept, as a
    local run.dir's report/ is; named as the run's staging folder is, but never that folder."""
    return reads_base() / mirror.staging_for(url).name


@contextlib.contextmanager
def fetched(url: str, weights: str, step: int | None = None, into: Path | None = None) -> Iterator[Copy]:
    """A local copy of the run.dir `url` for as long as the block runs (`into`: kept afterwards). `weights`:
    "none" (the report), "final" (model.safetensors; with `step`, checkpoint step-N instead), "newest"
    (generate: the newest complete checkpoint where it is newer than model.safetensors, else those), or
    "checkpoint" (eval: checkpoint step-N, else the newest complete one, else model.safetensors). A
    one-line refusal raised inside names the URL, never the local copy."""
    if objstore.credentials_in(url):
        raise DtrainError(
            f"RUN_DIR {objstore.without_credentials(url)} carries a password in the URL; give the store's "
            f"credentials through AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or a profile) instead"
        )
    objects = _listing(url)
    if into is None:
        reads_base().mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(dir=reads_base(), prefix="read-"))
    else:
        path = into
        path.mkdir(parents=True, exist_ok=True)
    try:
        names = [n for n in objects if _DESCRIBES.fullmatch(n)]
        sealed = {int(m.group(1)): objects[n][1] for n in objects if (m := _SEALED.fullmatch(n))}
        checkpoint = _checkpoint_to_read(url, objects, sealed, weights, step)
        if weights in ("final", "newest", "checkpoint") and checkpoint is None and "model.safetensors" in objects:
            names.append("model.safetensors")
        for name in names:
            _download(url, name, path, objects[name][1])
        if checkpoint is not None:
            try:
                local = RemoteCheckpointStore(url).download(checkpoint, path)
            except FileNotFoundError:
                raise DtrainError(
                    f"checkpoint step-{checkpoint} of {url} was deleted while it was read (a run still training "
                    f"keeps only its checkpoint.keep newest); run the command again"
                ) from None
            os.utime(local.path / MARKER, (sealed[checkpoint],) * 2)
        yield Copy(url, path, training=lease.NAME in objects and _held(url))
    except DtrainError as exc:
        raise _naming(exc, path, url) from None
    finally:
        if into is None:
            shutil.rmtree(path, ignore_errors=True)


def _checkpoint_to_read(
    url: str, objects: dict[str, tuple[int, float]], sealed: dict[int, float], weights: str, step: int | None
) -> int | None:
    if step is not None:
        if step not in sealed:
            have = ", ".join(f"step-{s}" for s in sorted(sealed)) or "none"
            raise DtrainError(f"{url} holds no complete checkpoint step-{step} (complete ones: {have})")
        return step
    if weights not in ("newest", "checkpoint") or not sealed:
        return None
    if weights == "checkpoint":
        return max(sealed)
    newest = max(sealed)
    final = objects.get("model.safetensors")
    return None if final is not None and final[1] >= sealed[newest] else newest


def _listing(url: str) -> dict[str, tuple[int, float]]:
    """Every object under the run.dir: (size, modification time). A run.dir with nothing there is one
    line: the bucket missing (or not visible to these credentials), or no run at that prefix."""
    fs, path = objstore.filesystem(url, KEY)
    root = path.rstrip("/")
    try:
        fs.invalidate_cache(root)
        found = fs.find(root, detail=True)
    except Exception as exc:
        if not isinstance(exc, FileNotFoundError):
            raise objstore.refusal(exc, url, KEY, fs, path) or exc from None
        found = {}
    objects = {
        name[len(root) + 1 :]: (int(info.get("size") or 0), _time(info))
        for name, info in found.items()
        if name.startswith(root + "/") and info.get("type") != "directory"
    }
    if not objects:
        raise objstore.refusal(FileNotFoundError(url), url, KEY, fs, path) or DtrainError(
            f"RUN_DIR {url} holds nothing: give the run.dir a dtrain run wrote to"
        )
    return objects


def _time(info: dict) -> float:
    stamp = info.get("LastModified") or info.get("mtime")
    if stamp is None:
        return 0.0
    return stamp.timestamp() if hasattr(stamp, "timestamp") else float(stamp)


def _download(url: str, name: str, folder: Path, mtime: float) -> None:
    target = folder / name
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = objstore.read_bytes(objstore.join(url, name), KEY)[0]
    except FileNotFoundError:  # replaced by the live run between the listing and now: read what it is now
        return
    target.write_bytes(data)
    os.utime(target, (mtime, mtime))


def _held(url: str) -> bool:
    try:
        lease.RunDirLease(url).check_free()
    except DtrainError:
        return True
    return False


def _naming(exc: DtrainError, path: Path, url: str) -> DtrainError:
    """`exc` with the local copy's path said as the URL it stands for."""
    said = DtrainError(str(exc).replace(str(path), url.rstrip("/")))
    said.exit_code = exc.exit_code
    return said
