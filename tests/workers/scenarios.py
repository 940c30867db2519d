"""Run under torchrun with 2 processes: dtrain's Trainer against a plain hand-written DDP loop, and
the recipe's promises one by one.

    torchrun --standalone --nproc-per-node 2 scenarios.py shared|owned OUT_DIR

Rank 0 writes OUT_DIR/results.json; the tests assert on it and on the run folders. One launch serves
several tests because starting processes is the slow part on 2 cores.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import tiny
import torch
import torch.distributed as dist
import torch.nn.functional as F
from faults import WithUnused
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

import dtrain
from dtrain.models import mlp

SEED = 7
N_TRAIN = 203  # neither the world size nor the batch divides it: padding and a partial last batch
BATCH = 16
EPOCHS = 2


JOB = {
    "run": {"seed": SEED},
    "data": {"batch_size": BATCH},
    "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
    "training": {"epochs": EPOCHS, "log_every": 1},
}


def data(n: int, seed: int) -> TensorDataset:
    return tiny.points(n, 20, seed, lambda x: (x[:, :4].argmax(dim=1) + (x[:, 4] > 1).long()) % 4)


def config(run_dir: Path, sections: dict | None = None, **training) -> dtrain.Config:
    return tiny.job_config(run_dir, JOB, sections, **training)


def fresh_model() -> torch.nn.Module:
    return tiny.seeded(lambda: mlp((20,), 4, hidden_size=32), SEED)


def plain_ddp_run(train: TensorDataset) -> tuple[list[float], torch.nn.Module]:
    """The guide's recipe written by hand: DistributedSampler(seed), set_epoch, DDP, SGD. Returns the
    per-step losses and the trained model."""
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
    return losses, model.module


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


class MapStyle(Dataset):
    """The same samples behind per-sample __getitem__ (the DataLoader path)."""

    def __init__(self, tensors: TensorDataset):
        self.x, self.y = tensors.tensors

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def shared(out: Path) -> None:
    dist.init_process_group("gloo")
    train, held_out = data(N_TRAIN, 0), data(101, 1)  # 101: odd, so ranks evaluate 51 and 50
    results: dict = {}

    # Parity: same per-step losses and final weights as the plain loop (also the run whose step
    # breakdown is checked).
    results["plain_losses"], plain_model = plain_ddp_run(train)
    trainer = dtrain.Trainer(config(out / "parity"), model=fresh_model(), train_data=train, eval_data=held_out)
    trainer.fit()
    results["group_alive_after_user_owned_fit"] = dist.is_initialized()
    results["parity_used_shared_memory"] = trainer.parallel.shared_memory is not None
    results["parity_weights_equal_plain"] = same_weights(trainer.module, plain_model)

    # The shared-memory average is bitwise gloo's at 2 ranks: the same run with gloo's all-reduce.
    over_gloo = dtrain.Trainer(
        config(out / "gloo", {"ddp": {"shared_memory_allreduce": False}}), model=fresh_model(), train_data=train
    )
    over_gloo.fit()
    results["gloo_used_shared_memory"] = over_gloo.parallel.shared_memory is not None
    results["gloo_weights_equal_shared_memory"] = same_weights(over_gloo.module, trainer.module)

    # DDP's static_graph changes how it schedules the all-reduce, never the numbers.
    static = dtrain.Trainer(
        config(out / "static", {"ddp": {"static_graph": True}}), model=fresh_model(), train_data=train
    )
    static.fit()
    results["static_graph_set"] = bool(static.model.static_graph)
    results["static_weights_equal"] = same_weights(static.module, trainer.module)

    # A model with a layer the forward pass never uses trains with find_unused_parameters=true.
    torch.manual_seed(SEED)
    unused = WithUnused((20,), 4)
    extra_before = unused.extra.weight.detach().clone()
    dtrain.Trainer(
        config(out / "unused", {"ddp": {"find_unused_parameters": True}}), model=unused, train_data=train
    ).fit()
    results["unused_extra_unchanged"] = torch.equal(unused.extra.weight.detach(), extra_before)

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

    # No all-reduce on skipped micro-batches: count DDP's communication calls with our own hook
    # (one bucket, DDP's own all-reduce, dtrain's timing hook off so ours can be registered).
    own_hook = {
        "ddp": {"bucket_cap_mb": 1000.0, "shared_memory_allreduce": False},
        "monitor": {"breakdown": False},
    }
    counted = dtrain.Trainer(
        config(out / "accum", own_hook, grad_accum_steps=4, max_steps=3), model=fresh_model(), train_data=train
    )
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
    shm = dtrain.Trainer(
        config(out / "accum_shm", {"ddp": {"bucket_cap_mb": 1000.0}}, grad_accum_steps=4, max_steps=3),
        model=fresh_model(),
        train_data=train,
    )
    shm.fit()
    results["shared_memory_calls"] = shm.parallel.shared_memory.calls

    # Accumulating 4 micro-batches of b equals one batch of 4b (203 samples: a partial last step).
    small = {"data": {"batch_size": 4}}
    dtrain.Trainer(config(out / "accum4", small, grad_accum_steps=4), model=fresh_model(), train_data=train).fit()
    dtrain.Trainer(config(out / "batch16"), model=fresh_model(), train_data=train).fit()
    # The same accumulation stated as nanoGPT states it: 32 samples a step over the 2 processes.
    stated = dtrain.Trainer(
        config(out / "global32", small, global_batch_size=32), model=fresh_model(), train_data=train
    )
    stated.fit()
    results["global32_accum"] = stated.grad_accum_steps

    # DDP equivalence: 2 ranks × batch 8 (the 1 rank × 16 side runs in the test process).
    dtrain.Trainer(
        config(out / "two_ranks", {"data": {"batch_size": 8}}), model=fresh_model(), train_data=data(200, 0)
    ).fit()

    # bf16 autocast on the CPU runs and learns, with clipping (its norm logged).
    bf16 = dtrain.Trainer(
        config(out / "bf16", {"optimizer": {"lr": 0.05}}, epochs=8, precision="bf16", max_grad_norm=1.0, log_every=5),
        model=fresh_model(),
        train_data=data(800, 2),
        eval_data=data(200, 3),
    )
    results["bf16"] = bf16.fit()
    with bf16.precision.autocast():  # the forward really computes in bf16
        results["bf16_output_dtype"] = str(bf16.module(train.tensors[0][:4]).dtype)
    results["threads"] = torch.get_num_threads()

    # torch's compression hooks take DDP's slot instead of the shared-memory average, and train.
    for hook in ("fp16", "powersgd"):
        compressed = dtrain.Trainer(
            config(out / f"hook_{hook}", {"ddp": {"comm_hook": hook}}), model=fresh_model(), train_data=train
        )
        compressed.fit()
        results[f"hook_{hook}"] = {
            "registered": [h.__name__ for h, _ in compressed.model._comm_hooks],
            "shared_memory": compressed.parallel.shared_memory is not None,
        }

    if dist.get_rank() == 0:
        (out / "results.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def owned(out: Path) -> None:
    """A Trainer that creates the process group destroys it, on success and on error."""
    results: dict = {}
    dtrain.Trainer(config(out / "owned", max_steps=2), model=fresh_model(), train_data=data(N_TRAIN, 0)).fit()
    results["alive_after_success"] = dist.is_initialized()

    def failing_loss(output, target):
        raise RuntimeError("loss exploded")

    # A second group in the same processes: a fresh file:// rendezvous, so no stale store keys.
    second = {"distributed": {"init_method": f"file://{out / 'rendezvous'}"}}
    try:
        dtrain.Trainer(
            config(out / "failing", second, max_steps=2),
            model=fresh_model(),
            train_data=data(N_TRAIN, 0),
            loss_fn=failing_loss,
        ).fit()
    except RuntimeError as exc:
        results["error"] = str(exc)
    results["alive_after_error"] = dist.is_initialized()
    if os.environ["RANK"] == "0":
        (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    mode, out_dir = sys.argv[1], Path(sys.argv[2])
    {"shared": shared, "owned": owned}[mode](out_dir)
