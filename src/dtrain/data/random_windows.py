"""`data.sampling = random` for token data: nanoGPT's get_batch, with the run's seed and exact resume.

Each micro-batch is `torch.randint(offsets, (batch_size,))` window starts — nanoGPT's
`torch.randint(len(data) - block_size, (batch_size,))` — drawn from a generator of this rank's own
(seeded from run.seed and the rank, so ranks draw different windows), each window block_size + 1 tokens
of one file. The generator runs on across epochs: an epoch only counts steps, as many as
`data.sampling = windows` would give (the GlobalOrderSampler's: the split's windows cut into whole global
batches), so epochs, progress and the schedule's length mean what they mean with windows.

The position is the generator's state after the last step drawn, kept per rank in the checkpoint
(`data_position-rank<R>.json`), so a resume draws what the unbroken run would have. A checkpoint
without it (one written with data.sampling = windows) is caught up by drawing the steps already taken.
The draws depend on the rank, so this order cannot continue on another number of processes.
"""

from __future__ import annotations

import base64
import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from dtrain.config import DataConfig
from dtrain.data.batch import to_device
from dtrain.data.sampler import GlobalOrderSampler
from dtrain.data.tokens import TokenWindows
from dtrain.errors import DataError


def window_generator(seed: int, rank: int) -> torch.Generator:
    """The generator rank `rank` draws its window starts from: one stream per (run.seed, rank), mixed so
    that seed s rank r + 1 is not seed s + 1 rank r."""
    mixed = int(np.random.SeedSequence([seed, rank]).generate_state(1, np.uint64)[0]) >> 1
    return torch.Generator().manual_seed(mixed)


class GeneratorPosition:
    """This rank's generator state and the steps it has drawn: checkpointed in a file per rank."""

    per_rank = True  # checkpoint.parts: each rank's state differs, so each rank writes its own file

    def __init__(self, batches: RandomWindows):
        self.batches = batches
        self.restored: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        state = self.batches.generator.get_state().numpy().tobytes()
        return {"steps": self.batches.drawn, "generator": base64.b64encode(state).decode("ascii")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.restored = state


class RandomWindows:
    """One rank's training batches of windows at random offsets; the same interface as TrainBatches:
    `stream(step)` yields a list of `accum` micro-batches per optimizer step."""

    def __init__(
        self,
        dataset: TokenWindows,
        data: DataConfig,
        grad_accum_steps: int,
        seed: int,
        rank: int,
        world_size: int,
        device: torch.device,
    ):
        if dataset.offsets == 0:
            raise DataError(
                f"data.sampling = random: the training split holds no window of data.block_size + 1 = "
                f"{dataset.block_size + 1} tokens in a file; lower data.block_size, or prepare more text"
            )
        self.dataset, self.seed, self.rank, self.device = dataset, seed, rank, device
        self.batch_size, self.accum = data.batch_size, grad_accum_steps
        # An epoch is as long as data.sampling = windows makes it (the sampler refuses less than one step).
        geometry = GlobalOrderSampler(len(dataset), rank, world_size, data.batch_size, seed, grad_accum_steps)
        self.micro_batches_per_epoch = geometry.global_batches
        self.steps_per_epoch = geometry.global_batches // grad_accum_steps
        self.generator = window_generator(seed, rank)
        self.drawn = 0  # optimizer steps whose micro-batches the generator has drawn
        self.position = GeneratorPosition(self)

    def parts(self) -> dict[str, Any]:
        """What the checkpoint keeps: this rank's generator state."""
        return {"data_position": self.position}

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[list[Any]]:
        """A look at the first batches (perf's FLOP count), from a generator of its own: the run's draws
        stay untouched."""
        return self._groups(window_generator(self.seed, self.rank))

    def close(self) -> None:
        """Nothing to end: windows are read in this process."""

    def stream(self, step: int) -> Iterator[list[Any]]:
        """Every step's micro-batches from `step` (the run's position) on, from the checkpointed
        generator state when there is one."""
        restored, self.position.restored = self.position.restored, None
        self.generator = window_generator(self.seed, self.rank)
        self.drawn = 0
        if restored is not None and int(restored["steps"]) == step:
            state = np.frombuffer(base64.b64decode(restored["generator"]), dtype=np.uint8).copy()
            self.generator.set_state(torch.from_numpy(state))
            self.drawn = step
        else:  # no position kept (a windows checkpoint): draw the steps already taken
            for _ in range(step * self.accum):
                self._offsets(self.generator)
            self.drawn = step
        return self._counted(self._groups(self.generator))

    def _counted(self, groups: Iterator[list[Any]]) -> Iterator[list[Any]]:
        for group in groups:
            self.drawn += 1
            yield group

    def _offsets(self, generator: torch.Generator) -> torch.Tensor:
        return torch.randint(self.dataset.offsets, (self.batch_size,), generator=generator)

    def _groups(self, generator: torch.Generator) -> Iterator[list[Any]]:
        # Drawn lazily, step by step: the state checkpointed after step k is the one step k + 1 draws from.
        for _ in itertools.count():
            yield [to_device(self.dataset.take_at(self._offsets(generator)), self.device) for _ in range(self.accum)]
