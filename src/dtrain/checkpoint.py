"""Saving what a run produces. Final weights today; scheduled checkpoints and resume build on this."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from safetensors.torch import save_model
from torch import nn


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` so that readers see the old file or the whole new one, never a part."""
    _atomic(path, lambda tmp: Path(tmp).write_text(text))


def save_final_weights(model: nn.Module, path: Path) -> None:
    """The trained weights as safetensors (loadable without pickle), written atomically."""
    _atomic(path, lambda tmp: save_model(model, tmp, metadata={"format": "pt"}))


def _atomic(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
