"""A data set without the fast path goes through a DataLoader whose workers persist across epochs and
take the same steps as the fast path."""

from tiny import small_config as config
from tiny import small_data as data
from tiny import small_model as model
from torch.utils.data import Dataset

import dtrain
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
