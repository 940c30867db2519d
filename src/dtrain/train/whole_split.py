"""Eval metrics over every prediction of the split at once (F1, AUC, BLEU): `dtrain.whole_split(fn)`.

    def f1(predictions, targets):  # the whole split: every eval sample exactly once, over all ranks
        return {"f1": sklearn.metrics.f1_score(targets, predictions.argmax(1), average="macro")}

    dtrain.Trainer(config, model=net, train_data=train, eval_data=test, eval_metrics=dtrain.whole_split(f1))

`predictions` are the model's class scores (its output, or the output's `.logits`) and `targets` the
batches' targets, each concatenated along the first dimension over every batch of every rank, on the CPU,
in the split's order. No sample is counted twice: the eval shards are never padded (see
data.sampler.eval_shard), and the repeats FSDP's evened batches add are left out — the padding
duplicates Accelerate's `gather_for_metrics` has to guess away are never gathered. `fn` runs on rank 0
alone; every rank receives its numbers. Per-batch means stay `eval_metrics=fn(output, batch)`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from dtrain import distributed
from dtrain.errors import DtrainError
from dtrain.train.loss import logits_of

SplitFn = Callable[[torch.Tensor, torch.Tensor], Mapping[str, Any]]


class WholeSplit:
    """`fn(predictions, targets)` for the whole eval split, as `Trainer(eval_metrics=...)` takes it."""

    def __init__(self, fn: SplitFn):
        if not callable(fn):
            raise DtrainError(f"whole_split takes a function fn(predictions, targets); got {type(fn).__name__}")
        self.fn = fn


def whole_split(fn: SplitFn) -> WholeSplit:
    """Mark `fn(predictions, targets) -> {name: number}` as a metric of the whole split (module docstring)."""
    return WholeSplit(fn)


class SplitOutputs:
    """One rank's predictions and targets over its eval batches, gathered and scored once at the end."""

    def __init__(self, metric: WholeSplit, interleaved: bool = True):
        self.metric, self.interleaved = metric, interleaved
        self.predictions: list[torch.Tensor] = []
        self.targets: list[torch.Tensor] = []

    def add(self, output: Any, target: Any) -> None:
        predictions = logits_of(output) if output is not None else None
        if predictions is None or not isinstance(target, torch.Tensor):
            raise DtrainError(
                "whole_split metrics need the model's output (a tensor or its .logits) and a target tensor per "
                "batch; with a step_fn, or a batch without a target, use a per-batch eval_metrics(output, batch)"
            )
        self.predictions.append(predictions.detach().float().cpu())
        self.targets.append(target.detach().cpu())

    def result(self) -> dict[str, float]:
        """The metric over every rank's samples, each once, in the split's order (a collective)."""
        mine = (_cat(self.predictions), _cat(self.targets))
        shares = [share for share in distributed.gather_objects(mine) if share[0] is not None]
        if not shares:
            return {}
        # Rank r holds samples r, r + world, r + 2·world, ... (eval_shard): interleaving restores the order.
        # An iterable set's shares (data.stream_eval) have no common order: rank after rank.
        order = _interleave if self.interleaved else torch.cat
        predictions = order([p for p, _ in shares])
        targets = order([t for _, t in shares])
        return distributed.rank0_decides(lambda: _scored(self.metric.fn, predictions, targets)) or {}


def _cat(parts: list[torch.Tensor]) -> torch.Tensor | None:
    if not parts:
        return None
    try:
        return torch.cat(parts)
    except RuntimeError:
        shapes = sorted({tuple(p.shape[1:]) for p in parts})
        raise DtrainError(
            f"whole_split metrics concatenate every batch's predictions and targets, but their shapes differ "
            f"beyond the first dimension ({shapes}); pad them to one length in collate_fn"
        ) from None


def _interleave(shares: list[torch.Tensor]) -> torch.Tensor:
    out = torch.empty((sum(len(s) for s in shares), *shares[0].shape[1:]), dtype=shares[0].dtype)
    for rank, share in enumerate(shares):
        out[rank :: len(shares)] = share
    return out


def _scored(fn: SplitFn, predictions: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    try:
        returned = fn(predictions, targets)
    except DtrainError:
        raise
    except Exception as exc:  # every rank must hear of it, not wait for rank 0's answer until the hang watch
        raise DtrainError(f"the whole_split eval metric raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(returned, Mapping):
        raise DtrainError(f'whole_split metric returned {type(returned).__name__}; return a dict, e.g. {{"f1": 0.9}}')
    result = {}
    for name, value in returned.items():
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise DtrainError(
                f"whole_split metric returned {name}={type(value).__name__}; return one number per name"
            ) from None
        result[name if name.startswith("eval_") else f"eval_{name}"] = number
    return result
