"""Run under torchrun with 2 processes: dtrain's Trainer against a plain hand-written DDP loop.

    torchrun --standalone --nproc-per-node 2 scenarios.py shared|owned|failing OUT_DIR

Rank 0 writes OUT_DIR/results.json; the tests assert on it. One launch serves several tests because
starting processes is the slow part on 2 cores.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

import dtrain
from dtrain.models import mlp

SEED = 7
N_TRAIN = 203  # neither the world size nor the batch divides it: padding and a partial last batch
BATCH = 16
EPOCHS = 2


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 20, generator=g)
    y = (x[:, :4].argmax(dim=1) + (x[:, 4] > 1).long()) % 4
    return TensorDataset(x, y)


def config(run_dir: Path, distributed: dict | None = None, **training) -> dtrain.Config:
    return dtrain.Config.from_dict({
        "run": {"dir": str(run_dir), "seed": SEED},
        "distributed": distributed or {},
        "data": {"batch_size": BATCH},
        "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        "training": {"epochs": EPOCHS, "log_every": 1, **training},
    })


def fresh_model() -> torch.nn.Module:
    torch.manual_seed(SEED)
    return mlp((20,), 4, hidden_size=32)


def plain_ddp_losses(train: TensorDataset) -> list[float]:
    """The guide's recipe written by hand: DistributedSampler(seed), set_epoch, DDP, SGD."""
    model = DDP(fresh_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = DistributedSampler(train, shuffle=True, seed=SEED)
    loader = DataLoader(train, batch_size=BATCH, sampler=sampler)
    losses = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / dist.get_world_size())
    return losses


class MapStyle(Dataset):
    """The same samples behind per-sample __getitem__ (the DataLoader path)."""

    def __init__(self, tensors: TensorDataset):
        self.x, self.y = tensors.tensors

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    train, held_out = data(N_TRAIN, 0), data(101, 1)  # 101: odd, so ranks evaluate 51 and 50
    results: dict = {}

    # Parity: same per-step losses as the plain loop.
    results["plain_losses"] = plain_ddp_losses(train)
    trainer = dtrain.Trainer(config(out / "parity"), model=fresh_model(), train_data=train,
                             eval_data=held_out)
    trainer.fit()
    results["group_alive_after_user_owned_fit"] = dist.is_initialized()

    # Exact eval: the 2-rank figure equals one process evaluating everything.
    results["eval_2_ranks"] = trainer.evaluate()
    with torch.no_grad():
        out_all = trainer.module(held_out.tensors[0])
        results["eval_1_process"] = {
            "eval_loss": F.cross_entropy(out_all, held_out.tensors[1]).item(),
            "eval_accuracy": (out_all.argmax(1) == held_out.tensors[1]).float().mean().item(),
        }

    # The DataLoader path (map-style data set) takes the very same steps.
    dtrain.Trainer(config(out / "loader"), model=fresh_model(), train_data=MapStyle(train)).fit()

    # No all-reduce on skipped micro-batches: count DDP's communication calls.
    # One bucket, so DDP makes one call per synced backward; DDP's own all-reduce, to count it.
    one_bucket = {"bucket_cap_mb": 1000.0, "shared_memory_allreduce": False}
    counted = dtrain.Trainer(config(out / "accum", one_bucket, grad_accum_steps=4, max_steps=3),
                             model=fresh_model(), train_data=train)
    counted.setup()
    calls = {"n": 0}

    def counting_hook(state, bucket):
        state["n"] += 1
        return default_hooks.allreduce_hook(None, bucket)

    counted.model.register_comm_hook(calls, counting_hook)
    counted.fit()
    results["allreduce_calls"] = calls["n"]
    results["accum_steps"] = counted.step
    # The same through dtrain's shared-memory averaging, which counts the buckets it averages.
    shared = dtrain.Trainer(config(out / "accum_shm", {"bucket_cap_mb": 1000.0}, grad_accum_steps=4,
                                   max_steps=3), model=fresh_model(), train_data=train)
    shared.fit()
    results["shared_memory_calls"] = shared.shared_memory.calls
    results["parity_used_shared_memory"] = trainer.shared_memory is not None
    results["threads"] = torch.get_num_threads()

    dist.destroy_process_group()

    if rank == 0:
        (out / "results.json").write_text(json.dumps(results))


def owned(out: Path, fail: bool) -> None:
    """A Trainer that creates the process group destroys it, on success and on error.

    (Separate launches: re-creating a group inside one torchrun worker can race on stale store keys.)
    """
    results: dict = {}

    def failing_loss(output, target):
        raise RuntimeError("loss exploded")

    try:
        dtrain.Trainer(config(out / "owned", max_steps=2), model=fresh_model(), train_data=data(N_TRAIN, 0),
                       loss_fn=failing_loss if fail else None).fit()
    except RuntimeError as exc:
        results["error"] = str(exc)
    results["group_alive"] = dist.is_initialized()
    if os.environ["RANK"] == "0":
        (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    mode, out_dir = sys.argv[1], Path(sys.argv[2])
    if mode == "shared":
        main(out_dir)
    else:
        owned(out_dir, fail=mode == "failing")
