"""A run that trains nothing: the logged training loss exactly the same for many steps.

Over batches of different samples a model that learns, or merely changes, never gives bitwise the same
mean loss twice in a row. Exactly the same value window after window means the loss does not depend on
the weights or the weights do not move (every gradient zero): parameters frozen (requires_grad=False),
a loss computed from something detached from the model, a learning rate of 0. Training goes on — the
user may mean it — but it is said once, since otherwise nothing in the console looks wrong.
"""

from __future__ import annotations

from typing import Any

# Steps of exactly the same loss before it is said: long enough that a short run of ties (a tiny data
# set repeating one batch) is not taken for it.
STALLED_STEPS = 50


class LossStall:
    def __init__(self, steps: int = STALLED_STEPS):
        self.steps = steps
        self._since: tuple[int, float] | None = None  # the step before the first window of this loss, the loss
        self._said = False

    def check(self, record: dict[str, Any], window_start: int) -> str | None:
        """The warning, once, when the train record ending at `record['step']` (its window started after
        `window_start`) carries the same loss as the windows before it for `steps` steps or more."""
        loss, step = record.get("loss"), record["step"]
        if self._said or not isinstance(loss, float) or record.get("grad_norm"):  # a gradient norm: it moves
            self._since = None
            return None
        if self._since is None or self._since[1] != loss:
            self._since = (window_start, loss)
            return None
        first = self._since[0]
        if step - first < self.steps:
            return None
        self._said = True
        return (
            f"warning: the training loss has been exactly {loss:.6g} for {step - first} steps (steps {first + 1}–"
            f"{step}): nothing trains. Check that the parameters require gradients, that the loss is computed from "
            f"the model's output, and that optimizer.lr is not 0"
        )
