"""How a batch becomes a loss — three ways, checked in this order:

1. `Trainer(step_fn=lambda model, batch: loss)`: full control; the model and batch as they are.
2. A dict batch → `model(**batch)`, and the loss taken from the output (`.loss`, `["loss"]`, or the
   output itself when it is one number, or a tuple's first element when it is one: `(loss, logits)`)
   — what every Hugging Face model does given `labels`. With `loss_fn`, `loss_fn(output, batch)` instead.
3. An `(inputs, target)` batch → `loss_fn(model(inputs), target)`; `(a, b, ..., target)` calls
   `model(a, b, ...)`. The default `loss_fn` is cross-entropy, over every position of a sequence.
   A batch with no target (one tensor, a namedtuple, a dataclass) → `model(batch)`, its loss taken
   from the output like a dict batch's (or `loss_fn(output, batch)`).

How micro-batches and ranks add up to one batch (`StepShares`): a loss that is a mean over target
tokens — the default cross-entropy over sequences, a Hugging Face model's `.loss` given sequence
`labels` — is weighted by its tokens (`-100` left out; after the model's own shift for a causal LM),
counted over every micro-batch of the step and every rank: the update is one batch's of the combined
size, as transformers does with `num_items_in_batch` (passed to a model whose forward takes it). Every
other loss (class labels, `loss_fn`, `step_fn`) is a mean over samples, weighted by samples.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dtrain.data.batch import IGNORE_INDEX, num_samples, split
from dtrain.errors import DtrainError
from dtrain.parallel.dtensors import is_dtensor

StepFn = Callable[[nn.Module, Any], torch.Tensor]
LossFn = Callable[[Any, Any], torch.Tensor]


def logits_of(output: Any) -> torch.Tensor | None:
    """The prediction in a model's output: the output itself, its `.logits` / `["logits"]`, or what
    follows the loss in a `(loss, logits, ...)` tuple."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and len(output) >= 2 and _is_one_number(output[0]):
        return output[1] if isinstance(output[1], torch.Tensor) else None
    found = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    return found if isinstance(found, torch.Tensor) else None


def cross_entropy(output: Any, target: torch.Tensor, per_item: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of class scores against integer classes; with (batch, positions, classes) scores
    against (batch, positions) targets — a language model — every position counts (-100: left out).
    The mean over the targets; with `per_item`, their sum divided by it (a share of a larger batch)."""
    logits = logits_of(output)
    if logits is None:
        raise DtrainError(
            f"the model returned {describe(output)}, and the default loss (cross-entropy) needs "
            f"class scores; return logits, or pass Trainer(loss_fn=...) or step_fn=..."
        )
    if logits.dim() > 2 and tuple(target.shape) == tuple(logits.shape[:-1]):
        logits, target = logits.flatten(0, -2), target.flatten()
    loss = F.cross_entropy(logits, target, reduction="mean" if per_item is None else "sum")
    if is_dtensor(loss):  # logits split over the vocabulary, under torch's loss_parallel():
        loss = loss.to_local()  # the whole loss on every rank, its backward reduced over the split
    return loss if per_item is None else loss / per_item


def loss_in(output: Any) -> torch.Tensor:
    """The loss a model computed itself (a Hugging Face model given labels): the output when it is one
    number, its `.loss` / `["loss"]`, or the first element of a tuple when that is one number — a
    Hugging Face model with `return_dict=False` returns `(loss, logits, ...)`. Else a one-line refusal
    naming what the output held."""
    if isinstance(output, torch.Tensor) and output.numel() == 1:
        return output.reshape(())
    found = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(found, torch.Tensor):
        return found
    if isinstance(output, (tuple, list)) and output:
        if _is_one_number(output[0]):
            return output[0].reshape(())
        at = next((i for i, item in enumerate(output) if _is_one_number(item)), None)
        if at is not None:  # the loss is there, elsewhere than first: say how to pick it
            raise DtrainError(
                f"the model returned {describe(output)}; dtrain takes a tuple's first element as the loss "
                f"when it is one number, and here it is element {at}: return (loss, ...) first, or pass "
                f"Trainer(loss_fn=lambda output, batch: output[{at}])"
            )
    raise DtrainError(
        f"the model's output holds no loss ({describe(output)}); put the targets in the batch "
        f"as 'labels' (a Hugging Face model then returns .loss), or pass Trainer(loss_fn=...) or "
        f"Trainer(step_fn=...)"
    )


def _is_one_number(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point()


def describe(output: Any) -> str:
    if isinstance(output, torch.Tensor):
        return f"a tensor of shape {tuple(output.shape)}"
    if isinstance(output, Mapping):
        shown = ", ".join(f"{k}={'None' if v is None else type(v).__name__}" for k, v in list(output.items())[:6])
        return f"a {type(output).__name__} with {shown or 'nothing'}"
    if isinstance(output, (tuple, list)):
        if not output:
            return f"an empty {type(output).__name__}"
        shown = ", ".join(describe(item) for item in output[:4]) + (", …" if len(output) > 4 else "")
        return f"a {type(output).__name__} of {len(output)} ({shown})"
    return f"a {type(output).__name__}"


def forward(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, tuple) and not hasattr(inputs, "_fields"):
        return model(*inputs)
    return model(inputs)


class LossOf:
    """`loss_of(model, batch)` → (loss, output, target), the way the module docstring says. `output`
    and `target` feed eval metrics (None where a step_fn hides them). With `per_item` (a token count,
    see `items`), a token-mean loss comes as its sum over the batch's tokens divided by `per_item`."""

    def __init__(self, step_fn: StepFn | None = None, loss_fn: LossFn | None = None):
        self.step_fn = step_fn
        self.loss_fn = loss_fn
        self._models: dict[int, _ModelLoss] = {}

    def __call__(
        self, model: nn.Module, batch: Any, per_item: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, Any, Any]:
        if self.step_fn is not None:
            return _one_number(self.step_fn(model, batch), "step_fn"), None, None
        inputs, target = split(batch)
        if target is None or isinstance(batch, Mapping):
            takes_items = per_item is not None and isinstance(inputs, Mapping) and self._takes_num_items(model)
            output = forward(model, {**inputs, "num_items_in_batch": per_item} if takes_items else inputs)
            loss = self.loss_fn(output, batch) if self.loss_fn else loss_in(output)
            items = self.items(model, batch) if per_item is not None and not takes_items else None
            if items is not None and per_item is not None:  # the model's own mean, weighted by its tokens
                loss = loss * (items / per_item)
        else:
            output = forward(model, inputs)
            return self.from_output(output, target, per_item), output, target
        return _one_number(loss, "loss_fn" if self.loss_fn else "the loss"), output, target

    @property
    def is_default(self) -> bool:
        """Whether a batch with a target takes dtrain's cross-entropy (no step_fn, no loss_fn): it takes
        logits split over the vocabulary too (loss parallel), which a user's function may not expect."""
        return self.step_fn is None and self.loss_fn is None

    def from_output(self, output: Any, target: Any, per_item: torch.Tensor | None = None) -> torch.Tensor:
        """The loss of an `(inputs, target)` batch from the model's output (`loss_fn`, else cross-entropy):
        what a pipeline's last stage computes, the model having run on other processes."""
        loss = self.loss_fn(output, target) if self.loss_fn else cross_entropy(output, target, per_item)
        return _one_number(loss, "loss_fn" if self.loss_fn else "the loss")

    def items(self, model: nn.Module, batch: Any) -> torch.Tensor | None:
        """How many target tokens the batch's loss is a mean over (on the device: no host sync), or None
        for a loss dtrain cannot see is a token mean (then samples weigh it)."""
        if self.step_fn is not None or self.loss_fn is not None:
            return None
        _, target = split(batch)
        if isinstance(batch, Mapping) and isinstance(batch.get("shift_labels"), torch.Tensor):
            target = batch["shift_labels"]  # a collator that shifted the labels itself (padding-free)
        elif isinstance(batch, Mapping) and self._model_loss(model).shifts_labels:
            target = target[..., 1:] if isinstance(target, torch.Tensor) else None  # position 0 predicts nothing
        if not isinstance(target, torch.Tensor) or target.dim() < 2 or target.is_floating_point():
            return None  # class labels, soft targets, regression: one item per sample
        return target.ne(IGNORE_INDEX).sum()

    def _takes_num_items(self, model: nn.Module) -> bool:
        return self._model_loss(model).takes_num_items

    def _model_loss(self, model: nn.Module) -> _ModelLoss:
        known = self._models.get(id(model))
        if known is None:
            known = self._models[id(model)] = _ModelLoss.of(model)
        return known


class _ModelLoss:
    """What a model's own loss does with its labels, read as transformers' Trainer reads it: whether it
    shifts them (a decoder-only causal LM) and whether its forward takes `num_items_in_batch`."""

    def __init__(self, shifts_labels: bool, takes_num_items: bool):
        self.shifts_labels, self.takes_num_items = shifts_labels, takes_num_items

    @classmethod
    def of(cls, model: nn.Module) -> _ModelLoss:
        inner = model
        while True:  # through the wrappers dtrain puts on: DDP's, torch.compile's (not imported for this)
            if isinstance(inner, DistributedDataParallel):
                inner = inner.module
            elif type(inner).__name__ == "OptimizedModule" and isinstance(inner._orig_mod, nn.Module):
                inner = inner._orig_mod
            else:
                break
        encoder_decoder = getattr(getattr(inner, "config", None), "is_encoder_decoder", False)
        # The loss function the model calls (transformers falls back to the causal LM's where its class
        # name says none, as for GPT2LMHeadModel).
        own_loss = getattr(inner, "loss_function", None) if hasattr(inner, "loss_type") else None
        shifts = getattr(own_loss, "__name__", "") == "ForCausalLMLoss" and not encoder_decoder
        takes = getattr(inner, "accepts_loss_kwargs", None)
        if takes is None:
            params = inspect.signature(inner.forward).parameters.values()
            takes = any(p.name == "num_items_in_batch" for p in params) or (
                hasattr(inner, "loss_function") and any(p.kind == p.VAR_KEYWORD for p in params)
            )
        return cls(shifts, bool(takes))


class StepShares:
    """Each micro-batch's share of one optimizer step's loss, so that the step (its micro-batches on
    every rank, gradients averaged by DDP or FSDP) updates the weights as one batch of all its samples:
    by tokens for a token-mean loss (their count over the step summed across ranks in one all-reduce of
    a scalar, started here so it overlaps what runs before the first loss), else by samples."""

    def __init__(self, loss_of: LossOf, model: nn.Module, micro_batches: list[Any], world_size: int):
        self.loss_of, self.model, self.world_size = loss_of, model, world_size
        counts = [loss_of.items(model, batch) for batch in micro_batches]
        self.sizes = [num_samples(batch) for batch in micro_batches]  # shapes: no host sync
        self.items: torch.Tensor | None = None
        self._pending: Any = None
        if counts and all(c is not None for c in counts):
            self.items = torch.stack(counts).sum()  # type: ignore[arg-type]
            if world_size > 1 and dist.is_initialized():
                self._pending = dist.all_reduce(self.items, async_op=True)

    def loss(self, index: int, batch: Any) -> torch.Tensor:
        """Micro-batch `index`'s weighted loss: the step's loss is the sum of these over its micro-batches
        (averaged over ranks)."""
        if self.items is None:
            loss = self.loss_of(self.model, batch)[0]
            n, n_step = self.sizes[index], sum(self.sizes)
            return loss if n == n_step else loss * (n / n_step)
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        # Divided by the tokens of every rank; DDP's (FSDP's) average over ranks is taken back here.
        return self.loss_of(self.model, batch, self.items)[0] * self.world_size

    def of_output(self, index: int, output: Any, target: Any) -> torch.Tensor:
        """As `loss`, from micro-batch `index`'s output and target (a pipeline's last stage: the model ran
        over every stage). The pipeline peers of a data-parallel replica count the same tokens: summed
        over every rank and multiplied by the world size, they weigh as over the replicas alone."""
        if self.items is None:
            n, n_step = self.sizes[index], sum(self.sizes)
            loss = self.loss_of.from_output(output, target)
            return loss if n == n_step else loss * (n / n_step)
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        return self.loss_of.from_output(output, target, self.items) * self.world_size


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
