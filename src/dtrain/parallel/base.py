"""The one interface every strategy offers the trainer and the checkpoint code."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dtrain.parallel.dims import ParallelDims


@dataclass(frozen=True)
class StageNames:
    """A pipeline stage's part of the model within the whole model, for what reads or writes its tensors
    under the whole model's names (checkpoints, weight files: they hold every stage's): every name of
    the whole model, and each tied parameter's other names (under which its writer may have held it)."""

    whole: frozenset[str]
    tied: Mapping[str, tuple[str, ...]]


class Strategy:
    """How the model is spread over the processes. This base is one process holding the whole
    model; `ddp.py` and `fsdp.py` spread it.

    `model` is what the training step calls (a wrapper, or the module itself); `module` is the user's
    own module, whose state dict (plain tensors, or DTensor shards under FSDP) checkpoints read;
    `dims` the dimensions of parallelism it spreads the module over (dims.py).
    """

    # What the rest of dtrain may ask of a strategy, so that nothing outside parallel/ names one:
    # Whether the forward pass is itself a collective (FSDP gathers parameters in it): then every rank
    # must run the same number of forward passes, in evaluation too.
    forward_is_collective = False
    # Whether each process holds only a shard of the parameters, gradients and optimizer state.
    shards_state = False
    # Whether its communication runs inside forward and backward (FSDP's gathers and reduce-scatters),
    # so the step time has no communication phase of its own to measure.
    comm_in_compute = False

    def __init__(self, module: nn.Module, dims: ParallelDims | None = None):
        self.module = module
        self.model: nn.Module = module
        self.dims = dims or ParallelDims()

    # A pipeline stage's place in the whole model (pipeline.py); None where this process holds all of it.
    stage: StageNames | None = None
    # Context parallel (context.py), where parallel.cp_size > 1: what a step runs inside.
    sequence_split: Any = None
    # Loss parallel: whether the model's logits come as a DTensor split over the vocabulary over the
    # tensor-parallel processes (tensor.py), which dtrain's cross-entropy takes without gathering them.
    split_logits = False

    @contextlib.contextmanager
    def step_context(self, micro_batches: list[Any]) -> Iterator[None]:
        """What the step's forward and backward passes (and its token count) run inside: each sequence
        split over the context-parallel processes, attention as a ring (context.py); loss parallel."""
        split = self.sequence_split.step(micro_batches) if self.sequence_split else contextlib.nullcontext()
        with split, self.loss_context():
            yield

    def loss_context(self) -> contextlib.AbstractContextManager:
        """What a loss over split logits is computed inside, its backward too: torch's `loss_parallel()`,
        whose cross-entropy reduces the softmax over the tensor-parallel processes; else nothing."""
        if not self.split_logits:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    # Whether this process computes the loss (every one, but a pipeline's stages before the last).
    computes_loss = True

    @property
    def eval_module(self) -> nn.Module:
        """What evaluation calls: the user's module (not DDP's wrapper: nothing to all-reduce)."""
        return self.module

    def forward_backward(self, micro_batches: list[Any], shares: Any, precision: Any) -> torch.Tensor:
        """Forward and backward over one step's micro-batches, each loss `shares.loss(i, batch)` (its share
        of the step), under `precision` (autocast, gradient scaler); returns their sum, detached.
        Gradients are averaged across processes on the last micro-batch only; the others add locally.
        A pipeline (pipeline.py) runs its schedule instead."""
        total = torch.zeros(())
        last = len(micro_batches) - 1
        for i, batch in enumerate(micro_batches):
            self.sync_gradients(i == last)
            with precision.autocast():
                loss = shares.loss(i, batch)
            precision.scaler.scale(loss).backward()
            total = total.to(loss.device) + loss.detach()
        return total

    def sync_gradients(self, enabled: bool) -> None:
        """Whether the next backward averages gradients across processes (off on accumulation
        micro-batches, which only add into the local gradients)."""

    def after_first_backward(self) -> None:
        """A chance to check the first backward (DDP: every parameter got a gradient)."""

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip every gradient by the global norm; returns that norm (before clipping) as a plain tensor."""
        return nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights on the CPU, on rank 0 (None elsewhere). Every rank calls it: under
        FSDP it is a collective."""
        return {k: v.detach().cpu() for k, v in self.module.state_dict().items()}
