"""Manifests: what a complete checkpoint holds, byte for byte (sizes and CRC-32s), and the check of a
folder against one."""

from __future__ import annotations

import zlib
from pathlib import Path


def crc32(path: Path) -> int:
    value = 0
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            value = zlib.crc32(block, value)
    return value


MARKER = "COMPLETE.json"  # what seals a checkpoint folder: its manifest, written last


def manifest_names(folder: Path) -> list[str]:
    return [str(p.relative_to(folder)) for p in sorted(folder.rglob("*")) if p.is_file()]


def manifest(folder: Path) -> dict[str, dict[str, int]]:
    """Size and CRC-32 of every file under `folder` (relative paths)."""
    return {
        str(p.relative_to(folder)): {"bytes": p.stat().st_size, "crc32": crc32(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def verify(folder: Path, expected: dict[str, dict[str, int]]) -> str | None:
    """None when `folder` holds exactly what `expected` lists; else what is wrong, naming the file."""
    unlisted = sorted(set(manifest_names(folder)) - set(expected) - {MARKER})
    if unlisted:
        return f"{folder / unlisted[0]} is not in its manifest (the marker omits it)"
    for name, want in expected.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != want["bytes"]:
            return f"{path} is truncated or altered ({size} bytes, {want['bytes']} expected)"
        if crc32(path) != want["crc32"]:
            return f"{path} is corrupt (checksum mismatch)"
    return None
