"""metrics.jsonl read back on a resume: whether it holds an evaluation of a step, and what an interrupted run
logged past the checkpoint its resume continues from dropped, so the file reads as one run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dtrain.files import atomic_write_text


def evaluated_at(path: Path, step: int) -> bool:
    """Whether the metrics file at `path` holds an evaluation's record of `step`."""
    return any(record.get("step") == step and "eval_loss" in record for record in _records(path))


def _records(path: Path) -> list[dict[str, Any]]:
    """The JSON records of a metrics file (a line cut short by an interruption left out)."""
    records = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def truncate_metrics(path: Path, step: int, drop_eval_at_step: bool) -> bool:
    """Drop what an interrupted run logged after the checkpoint it resumes from (and its eval at that
    step when the resumed run evaluates it again), so the file reads as one run. Whether it dropped any
    record (the trackers, which cannot, then start new runs: observe/trackers.py)."""
    if not path.is_file():
        return False
    kept, dropped = [], False
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by the interruption (logged nowhere else: monitor.py writes here first)
        at = record.get("step", 0)
        if at < step or (at == step and not ("eval_loss" in record and drop_eval_at_step)):
            kept.append(line)
        else:
            dropped = True
    atomic_write_text(path, "".join(f"{line}\n" for line in kept))
    return dropped
