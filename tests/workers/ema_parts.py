"""Run under torchrun with 2 processes: an EMA of the weights, registered for checkpointing, resumed.

    torchrun --standalone --nproc-per-node 2 ema_parts.py OUT_DIR

In one group, one Trainer after another:
    straight     trains 18 steps, the EMA registered (`trainer.register_for_checkpointing(ema=ema)`)
    stopped      the same, stopped at step 7 (training.stop_at_step), its checkpoint copied for the next two
    resumed      resumes it with a fresh EMA, begun from other weights (a resume that left the EMA alone
                 could not end equal), registered
    unregistered resumes the copy with the EMA not registered: it keeps its own
    plain        stops at step 7 without registering it; then a resume registers it
    refused      registers a part whose state holds a function: the first save refuses it
Rank 0 writes OUT_DIR/results.json; the test reads it, the run folders and what rank 0 said.
"""

import json
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import dtrain

N_TRAIN, BATCH = 96, 8  # 6 steps an epoch on 2 processes


class EMA:
    """An exponential moving average of a module's parameters, updated by the step itself."""

    def __init__(self, module: torch.nn.Module, decay: float = 0.8):
        self.decay = decay
        self.updates = 0
        self.shadow = {name: p.detach().clone() for name, p in module.named_parameters()}

    @torch.no_grad()
    def update(self, module: torch.nn.Module) -> None:
        for name, p in module.named_parameters():
            self.shadow[name].mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)
        self.updates += 1

    def state_dict(self) -> dict:
        return {"decay": self.decay, "updates": self.updates, "shadow": dict(self.shadow)}

    def load_state_dict(self, state: dict) -> None:
        self.decay, self.updates = state["decay"], state["updates"]
        for name, tensor in state["shadow"].items():
            self.shadow[name].copy_(tensor)


class WithAFunction:
    def state_dict(self) -> dict:
        return {"weights": torch.zeros(2), "on_step": print}

    def load_state_dict(self, state: dict) -> None:
        pass


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def train(run_dir: Path, data: TensorDataset, ema_seed: int | None, register: bool = True, **training) -> EMA:
    """A Trainer over `data` (the model always from seed 11) whose step updates an EMA begun from the
    weights of seed `ema_seed` (None: no EMA)."""
    config = dtrain.Config.from_dict(
        {
            "run": {"dir": str(run_dir), "seed": 3},
            "data": {"batch_size": BATCH},
            "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
            "training": {"epochs": 3, "log_every": 3, **training},
            "monitor": {"trackers": []},
        }
    )
    net = model(11)
    ema = EMA(model(ema_seed if ema_seed is not None else 11))

    def step_fn(wrapped: torch.nn.Module, batch) -> torch.Tensor:
        if ema_seed is not None:
            ema.update(net)
        x, y = batch
        return F.cross_entropy(wrapped(x), y)

    trainer = dtrain.Trainer(config, model=net, train_data=data, step_fn=step_fn)
    if register and ema_seed is not None:
        trainer.register_for_checkpointing(ema=ema)
    trainer.fit()
    return ema


def same(a: EMA, b: EMA) -> bool:
    return a.shadow.keys() == b.shadow.keys() and all(torch.equal(a.shadow[k], b.shadow[k]) for k in a.shadow)


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_TRAIN, 12, generator=g)
    data = TensorDataset(x, x[:, :3].argmax(1))
    results: dict = {}

    straight = train(out / "straight", data, ema_seed=5)
    train(out / "stopped", data, ema_seed=5, stop_at_step=7)
    if rank == 0:
        shutil.copytree(out / "stopped", out / "unregistered")
    dist.barrier()
    resumed = train(out / "stopped", data, ema_seed=23)
    unregistered = train(out / "unregistered", data, ema_seed=23, register=False)
    results["resumed_equal"] = same(straight, resumed)
    results["unregistered_equal"] = same(straight, unregistered)
    results["updates"] = [straight.updates, resumed.updates]

    train(out / "plain", data, ema_seed=None, stop_at_step=7)
    train(out / "plain", data, ema_seed=23, stop_at_step=9)

    try:
        config = dtrain.Config.from_dict({"run": {"dir": str(out / "refused")}, "training": {"stop_at_step": 2}})
        trainer = dtrain.Trainer(config, model=model(11), train_data=data)
        trainer.register_for_checkpointing(odd=WithAFunction())
        trainer.fit()
        results["refused"] = None
    except dtrain.DtrainError as exc:
        results["refused"] = str(exc)
    if rank == 0:
        (out / "results.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
