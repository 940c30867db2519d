"""What a model may offer the strategies that split it, declared in one place (torchtitan's
ModelProtocol does the same for its models). Every hook is optional: a model without one is refused,
in one line, only by the feature that needs it. The built-in GPT (models/gpt/) offers them all.

The strategies ask `offered(module)`, never the module's attributes themselves.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn


class ModelHooks(Protocol):
    """The optional hooks, as a model declares them (methods and attributes of its root module)."""

    def tp_plan(self, loss_parallel: bool = False) -> dict[str, Any]:
        """Tensor parallel (parallel.tp_size > 1): module name patterns → torch parallel styles
        (parallelize_module's plan). With `loss_parallel` (dtrain's own cross-entropy takes the logits),
        the plan may leave the logits split over the vocabulary; a plan without that parameter always
        gathers them."""
        ...

    def tp_problem(self, tp: int, window: int | None = None, sizes: Collection[int] | None = None) -> str | None:
        """Why `tp` processes cannot split the model (on windows of `window` tokens), in one line naming
        the sizes that would (of `sizes`, where given); None when they can. Asked by the launcher, on
        the model built on the meta device, before any worker starts."""
        ...

    # True when, under the model's own tp_plan, every dropout acts on a shard (sequence parallel, split
    # heads): each tensor-parallel rank then draws its own mask stream (dropout.py).
    tp_dropout_on_shards: bool

    # Context parallel (parallel.cp_size > 1) splits each sequence over processes and writes here the
    # positions of this rank's part (not 0..t-1: torch balances the causal work by reordering chunks);
    # the model embeds those when it is set, and its own positions when None.
    sequence_positions: torch.Tensor | None

    # Pipeline parallel needs no hook, but a contract: a stage's copy of the model has the parts it does
    # not hold set to None (stages.py), and the model's forward passes its input through such a part.


@dataclass(frozen=True)
class Offered:
    """What one model offers of ModelHooks."""

    tp_plan: Callable[..., dict[str, Any]] | None
    tp_problem: Callable[..., str | None] | None
    tp_dropout_on_shards: bool
    sequence_positions: bool  # it reads the positions context parallel writes

    def plan(self, loss_parallel: bool) -> tuple[dict[str, Any], bool]:
        """The model's own tensor-parallel plan, and whether it leaves the logits split (asked to, where
        `loss_parallel` and the plan takes the option)."""
        assert self.tp_plan is not None
        split = loss_parallel and "loss_parallel" in inspect.signature(self.tp_plan).parameters
        return (self.tp_plan(loss_parallel=True) if split else self.tp_plan()), split


def offered(module: nn.Module) -> Offered:
    """What `module` (the model's root) offers of ModelHooks."""
    plan, problem = getattr(module, "tp_plan", None), getattr(module, "tp_problem", None)
    return Offered(
        tp_plan=plan if callable(plan) else None,
        tp_problem=problem if callable(problem) else None,
        tp_dropout_on_shards=getattr(module, "tp_dropout_on_shards", False) is True,
        sequence_positions=hasattr(module, "sequence_positions"),
    )


def set_sequence_positions(module: nn.Module, positions: torch.Tensor | None) -> None:
    """Context parallel's positions for this rank's part of each sequence (None: the model's own)."""
    module.sequence_positions = positions  # type: ignore[assignment]  # declared by the model (ModelHooks)
