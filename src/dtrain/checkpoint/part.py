"""What every part of a checkpoint is (`Part`: captured, judged against what a checkpoint holds, put back)
and what a checkpoint being read holds (`Saved`); parts.py and stateful_parts.py are the parts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtrain.checkpoint.formats import FLAT_NAMES


@dataclass
class Saved:
    """A checkpoint as the parts reading themselves back see it."""

    folder: Path
    trainer: dict[str, Any]  # trainer.json
    tensors: dict[str, Any]  # DCP's metadata: tensor name → what is stored under it
    format: int

    @property
    def name(self) -> str:
        return self.folder.name

    @property
    def flat(self) -> bool:
        return self.format == FLAT_NAMES


class Part:
    """One named part: what it saves, how its trainer.json entry is judged, what it reads back."""

    def __init__(self, name: str):
        self.name = name

    def capture(self) -> tuple[dict[str, Any], Any]:
        """(its tensors, nested as DCP keys them under its name; its JSON for trainer.json, or None)."""
        return {}, None

    def write_files(self, folder: Path) -> None:
        """Files of its own beside DCP's and trainer.json (every rank calls it)."""

    def problem(self, entry: Any) -> str | None:
        """What is wrong with its trainer.json entry (None: nothing)."""
        return None

    def targets(self, saved: Saved) -> dict[str, Any]:
        """The tensors to read its state into (DCP loads them in place), refusing what would not fit."""
        return {}

    def restore(self, saved: Saved, tensors: dict[str, Any]) -> None:
        """Put the checkpoint's state back, from its JSON and the `tensors` DCP has filled."""

    def unfit(self, saved: Saved, exc: BaseException) -> str:
        """Why its state could not be put back (`exc`), in one line."""
        return (
            f"checkpoint {saved.name} does not fit this run's optimizer or schedule "
            f"({type(exc).__name__}: {exc}); delete {saved.folder} to resume from an earlier checkpoint, "
            f"or start a new run.dir"
        )


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_rate(value: Any) -> bool:
    """A finite number >= 0, as every optimizer and schedule setting dtrain saves is."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
