"""`checkpoint.keep_best`: the checkpoint with the best eval metric, kept apart from the newest-k pruning.

"eval_loss" (or "eval_loss:min") keeps the lowest, "eval_accuracy:max" the highest. A checkpoint is a
candidate when an evaluation ran at its step (align checkpoint.every_steps with training.eval_every_steps,
or checkpoint.every_epochs with training.eval_every): its metric is known only after it was written, so
the choice is recorded in checkpoints/best.json, which pruning reads and which a resume finds again.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from dtrain.config.checkpoint import best_rule
from dtrain.errors import DtrainError
from dtrain.files import atomic_write_text

BEST_FILE = "best.json"


class BestKeeper:
    """Which checkpoint is the best so far, on rank 0's disk (every rank checks the metric alike)."""

    def __init__(self, spec: str, root: Path, is_main: bool):
        self.rule = best_rule(spec) if spec else None
        self.path, self.is_main = root / BEST_FILE, is_main

    def step(self) -> int | None:
        """The best checkpoint's step, if one was chosen (rank 0 reads it: it alone prunes)."""
        best = self._read()
        return int(best["step"]) if best else None

    def consider(self, step: int, record: dict[str, Any], checkpointed: bool) -> None:
        """After the evaluation at `step`: the checkpoint of that step becomes the best if its metric beats it."""
        if self.rule is None:
            return
        name, mode = self.rule
        value = record.get(name)
        if not isinstance(value, (int, float)):
            reported = ", ".join(sorted(k for k in record if k.startswith("eval_"))) or "none"
            raise DtrainError(f"checkpoint.keep_best = '{name}' is not an eval metric this run reports ({reported})")
        if not (checkpointed and self.is_main and math.isfinite(value)):
            return
        best = self._read()
        if best is None or (value < best["value"] if mode == "min" else value > best["value"]):
            self.path.parent.mkdir(parents=True, exist_ok=True)  # never a half-written file for pruning to misread
            atomic_write_text(self.path, json.dumps({"step": step, "metric": name, "mode": mode, "value": value}))

    def _read(self) -> dict[str, Any] | None:
        if not self.is_main or not self.path.is_file():
            return None
        try:
            best = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None  # unreadable: no checkpoint is spared, the newest-k still are
        rule = self.rule
        if not rule or best.get("metric") != rule[0] or best.get("mode") != rule[1]:
            return None  # chosen by another rule: this run chooses again
        return best
