"""Run under torchrun with 2 processes: one model, one data set, fed as every batch shape dtrain takes.

    torchrun --standalone --nproc-per-node 2 batch_shapes.py OUT_DIR

The same samples in the same order reach the same linear classifier, as a tensor pair, a tensor triple,
a dict (through the fast path and through a DataLoader), a nested dict, a Hugging Face BatchEncoding, a
namedtuple, a dataclass, and a step_fn — each source and each way of finding the loss dtrain has. The
arithmetic is the same in every variant, so every variant must end with bitwise the same weights and
the same eval loss. Rank 0 writes OUT_DIR/results.json.
"""

import dataclasses
import json
import sys
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import dtrain

N, D, C = 120, 6, 3
Pair = namedtuple("Pair", ["x", "y"])


@dataclasses.dataclass
class Sample:
    x: torch.Tensor
    y: torch.Tensor


class Samples(Dataset):
    """Any map-style data set: sample i made by `make(x_i, y_i)` (the DataLoader path)."""

    def __init__(self, x, y, make):
        self.x, self.y, self.make = x, y, make

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.make(self.x[i], self.y[i])


class Linear(nn.Module):
    """One classifier, called in every way a batch can call it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.fc = nn.Linear(D, C)

    def forward(self, x=None, b=None, labels=None, features=None, input_ids=None):
        if features is not None:
            x = features["x"]
        if input_ids is not None:
            x = input_ids
        if isinstance(x, (Pair, Sample)):
            x, labels = x.x, x.y
        logits = self.fc(torch.cat([x, b], dim=1) if b is not None else x)
        if labels is None:
            return logits
        return SimpleNamespace(loss=F.cross_entropy(logits, labels), logits=logits)


def variants(x, y):
    half = D // 2
    encoding = None
    try:
        from transformers import BatchEncoding

        encoding = ("hf_batch_encoding", Samples(x, y, lambda a, b: BatchEncoding({"input_ids": a, "labels": b})), {})
    except ImportError:
        pass
    found = [
        ("tensor_pair_fast", TensorDataset(x, y), {}),
        ("tensor_pair_loader", Samples(x, y, lambda a, b: (a, b)), {}),
        ("tensor_triple_fast", TensorDataset(x[:, :half], x[:, half:], y), {}),
        ("dict_fast", {"x": x, "labels": y}, {}),
        ("dict_loader", Samples(x, y, lambda a, b: {"x": a, "labels": b}), {}),
        ("nested_dict_loader", Samples(x, y, lambda a, b: {"features": {"x": a}, "labels": b}), {}),
        ("namedtuple_loader", Samples(x, y, lambda a, b: Pair(a, b)), {}),
        ("dataclass_loader", Samples(x, y, lambda a, b: Sample(a, b)), {}),
        ("step_fn", TensorDataset(x, y), {"step_fn": lambda model, batch: F.cross_entropy(model(batch[0]), batch[1])}),
        ("loss_fn_on_dict", {"x": x, "labels": y}, {"loss_fn": lambda out, batch: out.loss}),
        (
            "eval_metrics",
            TensorDataset(x, y),
            {
                "eval_metrics": lambda out, batch: {
                    "hits": (out.argmax(1) == batch[1]).double().mean(),
                    "eval_mean_target": batch[1].double().mean(),
                }
            },
        ),
    ]
    return found + ([encoding] if encoding else [])


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=g)
    y = x[:, :C].argmax(1)
    ex, ey = torch.randn(30, D, generator=g), None
    ey = ex[:, :C].argmax(1)
    results = {}
    for name, data, extra in variants(x, y):
        config = dtrain.Config.from_dict(
            {
                "run": {"dir": str(out / name), "seed": 1},
                "data": {"batch_size": 8, "eval_batch_size": 7},
                "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
                "training": {"epochs": 2, "log_every": 3, "grad_accum_steps": 2},
            }
        )
        eval_data = (
            data.__class__(ex, ey, data.make)
            if isinstance(data, Samples)
            else (
                {"x": ex, "labels": ey}
                if isinstance(data, dict)
                else TensorDataset(*([ex[:, : D // 2], ex[:, D // 2 :], ey] if len(data.tensors) == 3 else [ex, ey]))
            )
        )
        model = Linear()
        last = dtrain.Trainer(config, model=model, train_data=data, eval_data=eval_data, **extra).fit()
        results[name] = {
            "weights": [p.detach().flatten().tolist() for p in model.parameters()],
            "eval": {k: v for k, v in last.items() if k.startswith("eval_")},
            "steps": last["step"],
        }
    if dist.get_rank() == 0:
        (out / "results.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
