"""Models a config can name ('faults:...') that fail on purpose, the way real jobs fail."""

import os
import signal
import time
from pathlib import Path

import torch
from torch import nn


class DyingMLP(nn.Module):
    """An MLP with dropout that SIGKILLs its own process at a chosen training forward pass — on one
    rank, in the first attempt only (torchrun's restart count is 0), as a crashed worker would —
    and that can be slowed down without changing what it computes."""

    def __init__(
        self,
        input_shape,
        num_classes,
        hidden_size=64,
        die_at_forward=0,
        die_rank=-1,
        dropout=0.1,
        note="",
        step_sleep_s=0.0,
        slow_rank=-1,
        slow_from_forward=0,
        stall_at_forward=0,
        stall_rank=-1,
        oom_at_forward=0,
        oom_gib=0,
        eval_sleep_s=0.0,
    ):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(int(torch.tensor(input_shape).prod()), hidden_size),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden_size, num_classes),
        )
        self.die_at = die_at_forward
        self.die_rank = die_rank
        self.note = note
        self.forwards = 0
        self.step_sleep_s = step_sleep_s  # slows training down (same numbers) so a test can catch it
        self.slow_rank = slow_rank  # only this rank sleeps (-1: every rank)
        self.slow_from = slow_from_forward  # steps slow down from this forward pass on (0: from the first)
        self.stall_at, self.stall_rank = stall_at_forward, stall_rank
        self.oom_at = oom_at_forward
        self.oom_gib = oom_gib  # > 0: really allocate this much on the device (a GPU's true OOM)
        self.eval_sleep_s = eval_sleep_s  # slows evaluation down (the last one: after the last step)

    def forward(self, x):
        if self.training:
            self.forwards += 1
            first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            rank = int(os.environ.get("RANK", "0"))
            if first_attempt and rank == self.die_rank and self.forwards == self.die_at:
                if self.note:
                    Path(self.note).write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            if first_attempt and rank == self.stall_rank and self.forwards == self.stall_at:
                stall_here_forever()
            if self.forwards == self.oom_at:
                if self.oom_gib:
                    torch.empty(int(self.oom_gib * 2**30), dtype=torch.uint8, device=x.device)
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            if self.slow_rank in (-1, rank) and self.forwards >= self.slow_from:
                time.sleep(self.step_sleep_s)
        else:
            time.sleep(self.eval_sleep_s)
        return self.net(x)


def stall_here_forever():
    """What a stuck data pipeline or a deadlock looks like from outside: no progress, no error."""
    time.sleep(3600)


def dying_mlp(input_shape, num_classes, **options):
    return DyingMLP(input_shape, num_classes, **options)


def wide_linear(input_shape, num_classes, width=4096):
    """Big enough (width × input features) that writing its checkpoint takes a noticeable while."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), width), nn.Linear(width, num_classes)
    )


class WithUnused(nn.Module):
    """A model with a layer the forward pass never uses: a classic DDP mistake."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.used = nn.Linear(int(torch.tensor(input_shape).prod()), num_classes)
        self.extra = nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x.flatten(1))


def with_unused(input_shape, num_classes):
    return WithUnused(input_shape, num_classes)


def shape_by_rank(input_shape, num_classes):
    """A model whose width depends on the rank: ranks disagree about the parameters' shapes."""
    width = 16 + 8 * int(os.environ.get("RANK", "0"))
    return nn.Sequential(
        nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), width), nn.ReLU(), nn.Linear(width, num_classes)
    )
