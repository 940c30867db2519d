"""How a batch becomes a loss — three ways, checked in this order:

1. `Trainer(step_fn=lambda model, batch: loss)`: full control; the model and batch as they are.
2. A dict batch → `model(**batch)`, and the loss taken from the output (`.loss`, `["loss"]`, or the
   output itself when it is one number) — what every Hugging Face model does given `labels`. With
   `loss_fn`, `loss_fn(output, batch)` instead.
3. An `(inputs, target)` batch → `loss_fn(model(inputs), target)`; `(a, b, ..., target)` calls
   `model(a, b, ...)`. The default `loss_fn` is cross-entropy, over every position of a sequence.
   A batch with no target (one tensor, a namedtuple, a dataclass) → `model(batch)`, its loss taken
   from the output like a dict batch's (or `loss_fn(output, batch)`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dtrain.data.batch import split
from dtrain.errors import DtrainError

StepFn = Callable[[nn.Module, Any], torch.Tensor]
LossFn = Callable[[Any, Any], torch.Tensor]


def logits_of(output: Any) -> torch.Tensor | None:
    """The prediction in a model's output: the output itself, or its `.logits` / `["logits"]`."""
    if isinstance(output, torch.Tensor):
        return output
    found = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    return found if isinstance(found, torch.Tensor) else None


def cross_entropy(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of class scores against integer classes; with (batch, positions, classes) scores
    against (batch, positions) targets — a language model — every position counts (-100: left out)."""
    logits = logits_of(output)
    if logits is None:
        raise DtrainError(
            f"the model returned {describe(output)}, and the default loss (cross-entropy) needs "
            f"class scores; return logits, or pass Trainer(loss_fn=...) or step_fn=..."
        )
    if logits.dim() > 2 and tuple(target.shape) == tuple(logits.shape[:-1]):
        logits, target = logits.flatten(0, -2), target.flatten()
    return F.cross_entropy(logits, target)


def loss_in(output: Any) -> torch.Tensor:
    """The loss a model computed itself (a Hugging Face model given labels), or a one-line refusal naming
    what the output held."""
    if isinstance(output, torch.Tensor) and output.numel() == 1:
        return output.reshape(())
    found = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(found, torch.Tensor):
        return found
    raise DtrainError(
        f"the model's output holds no loss ({describe(output)}); put the targets in the batch "
        f"as 'labels' (a Hugging Face model then returns .loss), or pass Trainer(loss_fn=...) or "
        f"Trainer(step_fn=...)"
    )


def describe(output: Any) -> str:
    if isinstance(output, torch.Tensor):
        return f"a tensor of shape {tuple(output.shape)}"
    if isinstance(output, Mapping):
        shown = ", ".join(f"{k}={'None' if v is None else type(v).__name__}" for k, v in list(output.items())[:6])
        return f"a {type(output).__name__} with {shown or 'nothing'}"
    if isinstance(output, (tuple, list)):
        return f"a {type(output).__name__} of {len(output)}"
    return f"a {type(output).__name__}"


def forward(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, tuple) and not hasattr(inputs, "_fields"):
        return model(*inputs)
    return model(inputs)


class LossOf:
    """`loss_of(model, batch)` → (loss, output, target), the way the module docstring says. `output`
    and `target` feed eval metrics (None where a step_fn hides them)."""

    def __init__(self, step_fn: StepFn | None = None, loss_fn: LossFn | None = None):
        self.step_fn = step_fn
        self.loss_fn = loss_fn

    def __call__(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, Any, Any]:
        if self.step_fn is not None:
            return _one_number(self.step_fn(model, batch), "step_fn"), None, None
        inputs, target = split(batch)
        output = forward(model, inputs)
        if target is None or isinstance(batch, Mapping):
            loss = self.loss_fn(output, batch) if self.loss_fn else loss_in(output)
        else:
            loss = (self.loss_fn or cross_entropy)(output, target)
        return _one_number(loss, "loss_fn" if self.loss_fn else "the loss"), output, target


def _one_number(loss: Any, source: str) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or (not loss.requires_grad and torch.is_grad_enabled()):
        if not isinstance(loss, torch.Tensor):
            raise DtrainError(
                f"{source} returned a {type(loss).__name__}, not a tensor; return the batch's mean "
                f"loss as a scalar tensor computed from the model's output"
            )
        why = "that does not require grad (computed without the model?)" if loss.numel() == 1 else "not one number"
        raise DtrainError(f"{source} returned {describe(loss)}, {why}; return the batch's mean loss as a scalar tensor")
    return loss.reshape(())
