"""Iterable data sets: a `torch.utils.data.IterableDataset` or a Hugging Face `datasets.IterableDataset`
(streaming), which yield samples one after the other and have no length.

Each rank reads its own share. A Hugging Face set is split by `datasets.distributed.split_dataset_by_node`
(whole shards where they divide among the processes, else every world-th example). Any other iterable is
read whole by every process and rank r keeps the samples at positions r, r + world, ... — within a rank,
DataLoader worker w of W keeps every W-th of those — so each sample is seen by exactly one process per
pass, whatever the data set does itself.

An epoch of an iterable data set is one pass over it. The stream runs on from one pass to the next
without a break (a micro-batch may hold the end of pass p and the start of pass p + 1; a data set with
`set_epoch` is told each pass's number, as Hugging Face's reshuffles by it), so every rank takes the same
number of steps whatever its share holds; the run's length is therefore `training.max_steps`.

The position (pass, samples read in it) is checkpointed per rank. Where the data set can say where it is
(`state_dict()` / `load_state_dict()`, as Hugging Face's `IterableDataset` has, or a torch iterable of the
user's) a resume continues at the next sample, exactly: with `data.num_workers = 0` the data set is read in
the training process and its own state is kept; with workers, each reads its copy of the share, and
torchdata's `StatefulDataLoader` gathers every worker's state (and which worker is next) into the loader's
`state_dict()`, which is kept. Where the data set cannot say its position, the resumed run starts that
pass again from its beginning, and says so in one line.
"""

from __future__ import annotations

import copy
import itertools
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from dtrain.config import DataConfig
from dtrain.data.batch import collate, to_device
from dtrain.data.workers import end_workers
from dtrain.errors import DataError


def is_stream(dataset: Any) -> bool:
    """Whether `dataset` is iterable-style (Hugging Face's `IterableDataset` is a torch one too)."""
    return isinstance(dataset, IterableDataset)


def _is_hugging_face(dataset: Any) -> bool:
    return type(dataset).__module__.startswith("datasets.")


def check_length(max_steps: int, dataset: Any) -> None:
    """An iterable data set has no length the run could count epochs by: its length is max_steps."""
    if max_steps <= 0:
        raise DataError(
            f"train_data is an iterable data set ({type(dataset).__name__}), with no length to count epochs "
            f"by; set training.max_steps, the run's length in optimizer steps"
        )


class RankShare(IterableDataset):
    """Rank `rank`'s share of a torch iterable, split again among DataLoader workers: sample i of a pass
    goes to the one (rank, worker) with i ≡ rank × W + worker (mod world × W)."""

    def __init__(self, dataset: Any, rank: int, world_size: int):
        self.dataset, self.rank, self.world_size = dataset, rank, world_size

    def __iter__(self) -> Iterator[Any]:
        worker = get_worker_info()
        workers, index = (1, 0) if worker is None else (worker.num_workers, worker.id)
        start, stride = self.rank * workers + index, self.world_size * workers
        return itertools.islice(iter(self.dataset), start, None, stride)

    def set_epoch(self, epoch: int) -> None:
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(epoch)


class StatefulRankShare(RankShare):
    """A RankShare of a data set that says its position: its state, and how many of the whole stream's
    samples this copy has read in the pass, from which a restored copy finds its next own sample.
    (A separate class: torchdata asks a data set whether it has `state_dict`, and a RankShare of a data
    set without one must answer no.)"""

    def __init__(self, dataset: Any, rank: int, world_size: int):
        super().__init__(dataset, rank, world_size)
        self.read, self.restored = 0, False

    def __iter__(self) -> Iterator[Any]:
        worker = get_worker_info()
        workers, index = (1, 0) if worker is None else (worker.num_workers, worker.id)
        start, stride = self.rank * workers + index, self.world_size * workers
        if not self.restored:
            self.read = 0
        # Samples to pass over before the next one of this copy's own (position ≡ start mod stride).
        ahead, self.restored = (start - self.read) % stride, False
        for sample in self.dataset:
            self.read += 1
            if ahead:
                ahead -= 1
                continue
            ahead = stride - 1
            yield sample

    def state_dict(self) -> dict[str, Any]:
        return {"data": self.dataset.state_dict(), "read": self.read}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state["data"])
        self.read, self.restored = int(state["read"]), True


def says_position(dataset: Any) -> bool:
    return callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))


def rank_share(dataset: Any, rank: int, world_size: int) -> Any:
    """This rank's share. Hugging Face's set splits itself among DataLoader workers too; any other is
    wrapped even on one process, so that its workers do not each yield the whole stream."""
    if not _is_hugging_face(dataset):
        return (StatefulRankShare if says_position(dataset) else RankShare)(dataset, rank, world_size)
    if world_size == 1:
        return dataset
    from datasets.distributed import split_dataset_by_node

    return split_dataset_by_node(dataset, rank=rank, world_size=world_size)


def _leave_sigterm_to_the_trainer(worker_id: int) -> None:
    """In each DataLoader worker: a session of its own, out of the process group a preemption's SIGTERM is
    sent to. That signal is the training process's to answer with a checkpoint, which needs the workers'
    state; torch's worker would die of it and fail the step. The loader still ends its workers (by their
    queue, or a signal to each), and a worker whose training process is gone ends itself."""
    os.setsid()


class StreamPosition:
    """Where this rank is in its share: the pass, the samples read in it, and the data set's own state
    where it can give one. Checkpointed in a file of each rank's own (`per_rank`)."""

    per_rank = True  # checkpoint.parts: each rank's state differs, so each rank writes its own file

    def __init__(self, stream: StreamBatches):
        self.stream = stream
        self.restored: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        s = self.stream
        if not s.exact:
            data = None
        elif s.num_workers > 0:  # the loader's: every worker's state, and which worker gives the next batch
            data = s.loader.state_dict() if s.loader is not None else {}
        else:
            data = s.source.state_dict()
        return {"pass": s.pass_, "samples": s.samples, "data": data}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.restored = state


class StreamBatches:
    """One rank's training batches from an iterable data set, one micro-batch after the other through
    its passes; `stream(step)` yields a list of `accum` micro-batches per optimizer step (the same
    interface as TrainBatches, which `epoch` also offers for a look at the first batch)."""

    def __init__(
        self,
        dataset: Any,
        data: DataConfig,
        grad_accum_steps: int,
        max_steps: int,
        rank: int,
        world_size: int,
        device: torch.device,
        collate_fn: Any = None,
    ):
        check_length(max_steps, dataset)
        self.dataset, self.rank, self.device = dataset, rank, device
        self.source = rank_share(dataset, rank, world_size)
        self.batch_size, self.accum, self.drop_last = data.batch_size, grad_accum_steps, data.drop_last
        # The run is one "epoch" of max_steps steps for the step counting the trainer does (epochs of an
        # iterable set are passes, counted here): evaluation runs after the last step.
        self.steps_per_epoch = self.micro_batches_per_epoch = max_steps
        self.collate_fn = collate_fn or collate
        self.num_workers = data.num_workers
        self.options: dict[str, Any] = {"num_workers": data.num_workers, "collate_fn": self.collate_fn}
        if data.num_workers > 0:
            self.options["prefetch_factor"] = data.prefetch_factor
            self.options["pin_memory"] = data.pin_memory and device.type == "cuda"
            self.options["worker_init_fn"] = _leave_sigterm_to_the_trainer
        # Exact resume: the data set says its position (in the training process, or in each worker through
        # the StatefulDataLoader).
        self.exact = says_position(self.source)
        self.pass_, self.samples = 0, 0
        self.loader: Any = None  # the pass's StatefulDataLoader (with workers, an exact set)
        self._pass_batches: Any = None  # the pass's DataLoader iterator (with workers): ended by close()
        self.position = StreamPosition(self)

    def parts(self) -> dict[str, Any]:
        """What the checkpoint keeps of the stream: its position on this rank."""
        return {"data_position": self.position}

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[list[Any]]:
        """A fresh stream from the start of pass `epoch` (a look at the first batch: perf's FLOP count),
        on a copy of the data set: the run's own position is left as it is."""
        look = copy.copy(self)
        if self.exact and self.num_workers == 0:  # read here, it would move the data set's own position
            look.source = copy.deepcopy(self.source)
        return look._groups(look._micro_batches(epoch, None))

    def stream(self, step: int) -> Iterator[list[Any]]:
        """Every step's micro-batches from `step` (the run's position) on: from the checkpointed position
        when there is one."""
        restored, self.position.restored = self.position.restored, None
        if step == 0 or restored is None:
            return self._groups(self._micro_batches(0, None))
        first_pass = int(restored["pass"])
        if restored.get("data") is None:
            if self.rank == 0:
                print(
                    f"note: resuming at step {step}: the training data ({type(self.dataset).__name__}) cannot say "
                    f"its position in a pass (no state_dict() and load_state_dict()), so pass {first_pass + 1} "
                    f"starts again from its beginning",
                    file=sys.stderr,
                    flush=True,
                )
            return self._groups(self._micro_batches(first_pass, None))
        return self._groups(self._micro_batches(first_pass, restored))

    def close(self) -> None:
        """End the DataLoader workers of the pass being read (the run is over: see workers.py)."""
        end_workers(self._pass_batches)

    def _groups(self, micro: Iterator[Any]) -> Iterator[list[Any]]:
        while True:
            yield [next(micro) for _ in range(self.accum)]

    def _micro_batches(self, first_pass: int, restored: dict[str, Any] | None) -> Iterator[Any]:
        """Micro-batches on the device, pass after pass without end."""
        if self.num_workers > 0:
            batches = self._loader_batches(first_pass, restored)
        else:
            # In this process: exactly batch_size samples read per batch, so the data set's state after a
            # step is the position of the next sample. A batch is filled across the end of a pass.
            samples = self._samples(first_pass, restored)
            batches = (self.collate_fn(list(itertools.islice(samples, self.batch_size))) for _ in itertools.count())
        for batch in batches:
            yield to_device(batch, self.device)

    def _passes(self, first_pass: int) -> Iterator[int]:
        for pass_ in itertools.count(first_pass):
            if callable(getattr(self.source, "set_epoch", None)):
                self.source.set_epoch(pass_)
            self.pass_, self.samples = pass_, 0
            yield pass_

    def _samples(self, first_pass: int, restored: dict[str, Any] | None) -> Iterator[Any]:
        for pass_ in self._passes(first_pass):
            resumed = restored is not None
            if restored is not None:  # the checkpoint's pass, from the sample after its position
                self.source.load_state_dict(restored["data"])
                self.samples, restored = int(restored["samples"]), None
            before = self.samples
            for sample in self.source:
                self.samples += 1
                yield sample
            self._refuse_an_empty_pass(pass_, self.samples - before + resumed)

    def _loader_batches(self, first_pass: int, restored: dict[str, Any] | None) -> Iterator[Any]:
        for pass_ in self._passes(first_pass):
            # Workers batch their own share; a pass ends with each worker's last, possibly partial, batch.
            with warnings.catch_warnings():  # torchdata calls an API torch has deprecated: not the user's to fix
                warnings.filterwarnings("ignore", message=".*set_vital.*")
                loader = self._loader()
                resumed = restored is not None
                if restored is not None:  # the checkpoint's pass: its loader continues where it was
                    loader.load_state_dict(restored["data"])
                    self.samples, restored = int(restored["samples"]), None
                batches = self._pass_batches = iter(loader)
            read = 0
            try:
                for batch in batches:
                    read += 1
                    self.samples += self.batch_size
                    yield batch
            finally:  # the pass's workers end with it, or with the stream closed part-way (not when collected)
                end_workers(batches)
            self._refuse_an_empty_pass(pass_, read + resumed)

    def _loader(self) -> Any:
        """A pass's loader. StatefulDataLoader (for a data set that says its position): a snapshot of every
        worker's state after each batch (snapshot_every_n_steps=1), so the state a checkpoint takes after
        any step is exact and a resume reads no batch twice."""
        # Its own generator: a loader draws its workers' seed from it, and drawn from the global RNG that would
        # shift dropout's numbers on a resume (which builds the pass's loader once more).
        generator = torch.Generator().manual_seed(self.pass_)
        options = {"batch_size": self.batch_size, "drop_last": self.drop_last, "generator": generator, **self.options}
        if not self.exact:
            return DataLoader(self.source, **options)
        from torchdata.stateful_dataloader import StatefulDataLoader

        self.loader = StatefulDataLoader(self.source, snapshot_every_n_steps=1, **options)
        return self.loader

    def _refuse_an_empty_pass(self, pass_: int, read: int) -> None:
        if read == 0:  # a pass of nothing would loop for ever
            raise DataError(
                f"the training data ({type(self.dataset).__name__}) gave rank {self.rank} no sample in pass "
                f"{pass_ + 1}; it needs at least one sample per process (and per DataLoader worker)"
            )
