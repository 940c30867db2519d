"""A data set without the fast path goes through a DataLoader whose workers persist across epochs and
take the same steps as the fast path."""

import gc
import multiprocessing

import pytest
import torch
from tiny import SMALL, Resumable, job_config
from tiny import small_config as config
from tiny import small_data as data
from tiny import small_model as model
from torch.utils.data import Dataset

import dtrain
from dtrain.config import DataConfig
from dtrain.data.loaders import TrainBatches
from dtrain.data.sampler import train_sampler
from dtrain.data.streams import StreamBatches
from helpers import train_lines

# --- DataLoader workers, eval_every ----------------------------------------------------------------


class MapStyle(Dataset):
    def __init__(self, tensors):
        self.x, self.y = tensors.tensors

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def test_dataloader_workers_persist_and_take_the_same_steps(tmp_path):
    workers = {"num_workers": 2, "persistent_workers": True, "prefetch_factor": 3}
    with_workers = dtrain.Trainer(
        config(tmp_path / "workers", data=workers), model=model(), train_data=MapStyle(data())
    )
    with_workers.fit()
    in_memory = dtrain.Trainer(config(tmp_path / "tensors"), model=model(), train_data=data())
    in_memory.fit()
    assert [m["loss"] for m in train_lines(tmp_path / "workers")] == [
        m["loss"] for m in train_lines(tmp_path / "tensors")
    ]
    ((loader, _),) = with_workers.train_batches._source._loaders.values()
    assert (loader.num_workers, loader.persistent_workers, loader.prefetch_factor) == (2, True, 3)
    assert loader.pin_memory is False  # pinning helps copies to a GPU only; this run has none


# --- workers end when their batches are done ------------------------------------------------------
# A pass of an iterable set, a stream closed part-way, an epoch's persistent workers at the end of the
# run, a Trainer's after fit(): ended then, not when the garbage collector reaches their iterator (which
# gives each worker 5 s and then kills it: a pause at some later, unrelated moment of a long-lived
# process). The collector is off in these tests, so only an explicit end passes them.

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def no_collector():
    """The collector off; the DataLoader workers started since, still alive."""
    before = set(multiprocessing.active_children())
    gc.disable()
    try:
        yield lambda: [p for p in multiprocessing.active_children() if p not in before]
    finally:
        gc.enable()


def test_each_pass_of_a_stream_ends_its_workers_and_so_does_closing_it_part_way(no_collector):
    # A set that says its position reads through torchdata's StatefulDataLoader, whose iterator and loader
    # hold each other: only the collector would free them.
    # 10 samples, 2 workers reading every other one, batches of 2: 3 + 3 batches a pass.
    stream = StreamBatches(Resumable(10), DataConfig(batch_size=2, num_workers=2), 1, 100, 0, 1, CPU)
    batches = stream.stream(0)
    next(batches)
    first_pass = no_collector()
    assert len(first_pass) == 2
    for _ in range(6):  # into the second pass
        next(batches)
    second_pass = no_collector()
    assert len(second_pass) == 2 and not set(first_pass) & set(second_pass)
    batches.close()  # part-way through the second pass
    assert no_collector() == []


def test_persistent_workers_live_from_epoch_to_epoch_and_end_with_close(no_collector):
    n, size = 24, 4
    sampler = train_sampler(n, 0, 1, size, seed=0, accum=1, global_order=False)
    batches = TrainBatches(MapStyle(data(n)), sampler, DataConfig(batch_size=size, num_workers=2), 1, CPU)
    stream = batches.stream(0)
    for _ in range(batches.steps_per_epoch + 1):  # one epoch and a step of the next
        next(stream)
    workers = no_collector()
    assert len(workers) == 2  # the first epoch's, still serving the second (data.persistent_workers)
    batches.close()
    assert no_collector() == []


@pytest.mark.parametrize("kind", ["map-style", "iterable"])
def test_a_trainer_leaves_no_dataloader_worker_behind_after_fit(no_collector, tmp_path, kind):
    if kind == "map-style":
        train, training, net, step_fn = MapStyle(data(64)), {"epochs": 2}, model(), None
    else:
        train, training, net = Resumable(64), {"max_steps": 6}, torch.nn.Embedding(64, 4)
        step_fn = lambda module, batch: module(batch).pow(2).mean()  # noqa: E731
    sections = {"data": {"num_workers": 2}, "training": training, "monitor": {"trackers": []}}
    trainer = dtrain.Trainer(job_config(tmp_path, SMALL, sections), model=net, train_data=train, step_fn=step_fn)
    trainer.fit()
    assert trainer.step == trainer.total_steps > 0
    assert no_collector() == []
