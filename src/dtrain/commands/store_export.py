"""`dtrain export ... --out s3://bucket/prefix`: a finished export folder sent to an object store so that
no reader ever takes half of one for an export.

A store has no rename, so the folder cannot appear whole at once. What makes a prefix a Hugging Face model
is its `config.json` (`from_pretrained` reads nothing without it): it is deleted first (an earlier export
there stops being one), then every other file goes up (and the earlier export's files this one does not
have are deleted), and `config.json` last, after the listing shows every other file with its size. A write
cut short leaves a prefix without `config.json`, which nothing loads and the next export there replaces.
"""

from __future__ import annotations

import re
from pathlib import Path

from dtrain import objstore
from dtrain.errors import DtrainError
from dtrain.rundir import HF_EXPORT_NAMES

KEY = "--out"
LAST = "config.json"


def check_free(url: str) -> None:
    """--out must hold nothing, or only what an export writes (an earlier export, or one cut short):
    never someone's objects. Also where the store refuses the bucket or the credentials: one line."""
    there = objstore.listing(url, KEY)
    if not there:
        fs, path = objstore.filesystem(url, KEY)
        refused = objstore.refusal(FileNotFoundError(url), url, KEY, fs, path)
        if refused is not None:  # a missing bucket: found out before the export is written
            raise refused
        return
    strangers = sorted(name for name in there if not re.fullmatch(HF_EXPORT_NAMES, name))
    if strangers:
        raise DtrainError(
            f"--out {url} holds {', '.join(strangers[:3])}, which an export does not write (objects of yours?); "
            f"export writes there only over an earlier export: choose another --out, or move them"
        )


def upload(folder: Path, url: str) -> None:
    """Send the export `folder` to the prefix `url`: config.json deleted first, sent last (see above)."""
    files = sorted(p.name for p in folder.iterdir() if p.is_file())
    earlier = objstore.listing(url, KEY)
    objstore.remove([objstore.join(url, LAST)], KEY)
    objstore.remove([objstore.join(url, name) for name in sorted(earlier) if name not in files], KEY)
    for name in files:
        if name != LAST:
            objstore.write_bytes(objstore.join(url, name), (folder / name).read_bytes(), KEY)
    there = objstore.listing(url, KEY)
    short = [name for name in files if name != LAST and there.get(name) != (folder / name).stat().st_size]
    if short:
        raise DtrainError(
            f"the export did not reach {url} whole ({short[0]}); it has no {LAST} there, so nothing loads it: "
            f"run the same command again"
        )
    objstore.write_bytes(objstore.join(url, LAST), (folder / LAST).read_bytes(), KEY)
