"""The tiny jobs the tests train: a config made of a few sections, labelled random points, a seeded model.

One builder for the test modules and for the worker scripts torchrun starts (both have this folder on their
path), so that every test's job reads as its differences from its module's defaults.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.utils.data import IterableDataset, TensorDataset

import dtrain

T = TypeVar("T")


def job_config(
    run_dir: Path | str, defaults: dict[str, dict[str, Any]], sections: dict | None = None, **training: Any
) -> dtrain.Config:
    """`defaults` (section → keys) in `run_dir`, each of `sections` merged over them key by key, then
    `training` keys over the training section."""
    raw: dict[str, dict[str, Any]] = {name: dict(keys) for name, keys in defaults.items()}
    raw.setdefault("run", {})["dir"] = str(run_dir)
    for section, keys in {**(sections or {}), "training": {**(sections or {}).get("training", {}), **training}}.items():
        raw[section] = {**raw.get(section, {}), **keys}
    return dtrain.Config.from_dict(raw)


def points(n: int, features: int, seed: int, label: Callable[[torch.Tensor], torch.Tensor]) -> TensorDataset:
    """`n` standard-normal points of `features` values, the same for a seed, labelled by `label(x)`."""
    x = torch.randn(n, features, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, label(x))


def seeded(build: Callable[[], T], seed: int) -> T:
    """`build()` under torch's global seed `seed`: the same initial weights, call after call."""
    torch.manual_seed(seed)
    return build()


# --- the small classification job several test modules train ---------------------------------------

IN, HIDDEN, OUT = 12, 32, 3
SMALL = {
    "data": {"batch_size": 16},
    "optimizer": {"name": "sgd", "lr": 0.1},
    "training": {"epochs": 2, "log_every": 5},
}


def small_data(n: int = 160, seed: int = 0) -> TensorDataset:
    """`n` points of IN features, labelled by the largest of their first OUT."""
    return points(n, IN, seed, lambda x: x[:, :OUT].argmax(1))


def small_model() -> torch.nn.Module:
    return seeded(
        lambda: torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT)), 0
    )


def small_config(run_dir: Path | str, **sections: dict) -> dtrain.Config:
    return job_config(run_dir, SMALL, sections)


class Resumable(IterableDataset):
    """0, 1, ..., n - 1, saying its position: load_state_dict makes the next iteration continue there."""

    def __init__(self, n: int):
        self.n, self.next, self.start = n, 0, 0

    def __iter__(self):
        self.next, self.start = self.start, 0
        while self.next < self.n:
            self.next += 1
            yield torch.tensor(self.next - 1)

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.start = state["next"]
