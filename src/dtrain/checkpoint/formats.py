"""Checkpoint formats, by number: what each dtrain wrote, and the one place a checkpoint's number is read.

    1  flat DCP names of dtrain's own ("model/<fqn>", "optimizer/<fqn>/<name>"); the earliest kept every
       visible GPU's RNG state as cuda_<i>, and their markers did not say samples_per_step
    2  DCP's own nested paths ("model.<fqn>", "optimizer.state.<fqn>.<name>"); no format number yet
    3  "format" in COMPLETE.json and trainer.json; trainer.json names the parts it holds (model, optimizer,
       scheduler, scaler, rng and every registered one), each part's tensors under its name in DCP

Checkpoints 1 and 2 carry no number: `of_trainer` tells them apart once, by their tensor names, and
every compatibility branch asks the number, never the contents.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

FLAT_NAMES = 1
NESTED_NAMES = 2
NAMED_PARTS = 3
CURRENT = NAMED_PARTS


def stated_problem(value: Any) -> str | None:
    """What is wrong with a "format" a file states (None: a number this dtrain reads)."""
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= NAMED_PARTS):
        return f"format {value!r}, not a whole number >= {NAMED_PARTS}"
    return None


def newer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > CURRENT


def newer_refusal(name: str, value: int) -> str:
    return (
        f"checkpoint {name} was written by a newer dtrain (checkpoint format {value}; this one reads up to "
        f"{CURRENT}): resume it with that dtrain or a later one, or start a new run.dir"
    )


def of_trainer(trainer: dict[str, Any], tensor_names: Iterable[str]) -> int:
    """The format of a checkpoint whose trainer.json is `trainer` (its shape already checked) and whose DCP
    metadata lists `tensor_names`."""
    if "format" in trainer:
        return int(trainer["format"])
    return FLAT_NAMES if any(name.startswith("model/") for name in tensor_names) else NESTED_NAMES
