"""Pieces of the recipe that one process can show: schedules, optimizers, clipping, threads."""

import math

import pytest
import torch
from torch.utils.data import TensorDataset

import dtrain
from dtrain.config import Config, OptimizerConfig
from dtrain.train.optim import build, build_optimizer
from dtrain.train.schedules import Shape
from helpers import WORKERS, ok
from helpers import dtrain as dtrain_cli


def lrs(name, warmup, total, floor=0.0):
    config = Config.from_dict(
        {"optimizer": {"lr": 0.5}, "scheduler": {"name": name, "warmup_steps": warmup, "min_lr_ratio": floor}}
    )
    optimizer, scheduler = build(config, torch.nn.Linear(2, 2), (None, None), torch.device("cpu"), total)
    seen = []
    for _ in range(total):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return seen


def test_warmup_then_constant():
    """Warm-up as transformers': step k of 4 at k/4 of the peak, the first at 0."""
    seen = lrs("constant", 4, 10)
    assert seen[:4] == pytest.approx([0.0, 0.125, 0.25, 0.375])
    assert seen[4:] == pytest.approx([0.5] * 6)


def test_cosine_decays_to_the_floor():
    seen = lrs("cosine", 2, 12, floor=0.1)
    assert seen[2] == pytest.approx(0.5)
    assert seen[7] == pytest.approx(0.05 + 0.45 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert all(a >= b for a, b in zip(seen[2:], seen[3:]))
    assert Shape("cosine", 2, 12, 0.1, {})(12) == pytest.approx(0.1)  # the multiplier at the end: the floor


def test_linear_decay():
    seen = lrs("linear", 0, 5)
    assert seen == pytest.approx([0.5, 0.4, 0.3, 0.2, 0.1])


def test_optimizers():
    params = torch.nn.Linear(2, 2)
    sgd = build_optimizer(OptimizerConfig(name="sgd", lr=0.1, momentum=0.8, nesterov=True), params)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.8 and sgd.defaults["nesterov"]
    adamw = build_optimizer(OptimizerConfig(name="adamw", lr=1e-3, betas=[0.8, 0.9], weight_decay=0.1), params)
    assert isinstance(adamw, torch.optim.AdamW) and adamw.defaults["betas"] == (0.8, 0.9)


def test_clipping_bounds_the_update_and_logs_the_norm(tmp_path):
    """One process, the API: plain SGD at lr 1 moves the weights by exactly the clipped gradient."""
    torch.manual_seed(0)
    x, y = torch.randn(32, 5) * 100, torch.randint(0, 3, (32,))
    model = torch.nn.Linear(5, 3)
    before = [p.detach().clone() for p in model.parameters()]
    config = dtrain.Config.from_dict(
        {
            "run": {"dir": str(tmp_path)},
            "data": {"batch_size": 32},
            "optimizer": {"name": "sgd", "lr": 1.0, "momentum": 0.0},
            "training": {"epochs": 1, "max_grad_norm": 0.01, "log_every": 1},
        }
    )
    last = dtrain.Trainer(config, model=model, train_data=TensorDataset(x, y)).fit()
    moved = torch.sqrt(sum(((p.detach() - b) ** 2).sum() for p, b in zip(model.parameters(), before)))
    assert moved.item() == pytest.approx(0.01, rel=1e-4)
    assert last["grad_norm"] > 1.0  # the norm before clipping, as logged


def test_workers_split_the_cores(tmp_path):
    """Under dtrain's launcher each of N workers gets cores // N intra-op threads."""
    import os

    ok(dtrain_cli("launch", "--nproc", "2", str(WORKERS / "report_threads.py"), str(tmp_path)))
    cores = len(os.sched_getaffinity(0))
    for rank in range(2):
        assert int((tmp_path / f"threads-{rank}").read_text()) == max(1, cores // 2)
