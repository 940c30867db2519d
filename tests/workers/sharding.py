"""Run under torchrun (2 processes, or 4 for `hsdp`): FSDP2 against DDP with dtrain's Trainer.

    torchrun --standalone --nproc-per-node 2 sharding.py fsdp OUT_DIR
    torchrun --standalone --nproc-per-node 4 sharding.py hsdp OUT_DIR

Rank 0 writes OUT_DIR/results.json; the tests read it and the run folders. One launch, several checks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import tiny
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset

import dtrain
from dtrain.errors import DtrainError
from dtrain.models.gpt import GPT

VOCAB, BLOCK = 64, 16


def tokens(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, VOCAB, (n, BLOCK + 1), generator=g)
    seq[:, 1::2] = (seq[:, 0::2][:, : seq[:, 1::2].shape[1]] * 7 + 3) % VOCAB  # something to learn
    return TensorDataset(seq[:, :-1], seq[:, 1:])


JOB = {
    "run": {"seed": 3},
    "data": {"batch_size": 4, "eval_batch_size": 5},
    "optimizer": {"name": "adamw", "lr": 0.01},
    "training": {"max_steps": 8, "log_every": 1},
    "checkpoint": {"every_steps": 4},
}


def config(run_dir: Path, strategy: str, **training) -> dtrain.Config:
    spread = {"strategy": strategy, **({"hsdp_shard_size": 2} if strategy == "hsdp" else {})}
    return tiny.job_config(run_dir, JOB, {"parallel": spread}, **training)


def model() -> GPT:
    return tiny.seeded(lambda: GPT(VOCAB, block_size=BLOCK, n_layer=2, n_head=2, n_embd=16), 3)


def train(run_dir: Path, strategy: str, **training) -> dtrain.Trainer:
    # 11 held-out samples with batches of 5 over 2 ranks: rank 0 runs 2 batches, rank 1 one (FSDP must
    # even them out, and count nothing twice).
    trainer = dtrain.Trainer(
        config(run_dir, strategy, **training), model=model(), train_data=tokens(96, 0), eval_data=tokens(11, 1)
    )
    trainer.fit()
    return trainer


def local_bytes(tensors) -> tuple[int, int]:
    """(this rank's bytes, the whole model's bytes) of `tensors`, DTensor shards counted as held."""
    held = whole = 0
    for t in tensors:
        size = t.element_size()
        held += (t.to_local().numel() if isinstance(t, DTensor) else t.numel()) * size
        whole += t.numel() * size
    return held, whole


def main(mode: str, out: Path) -> None:
    dist.init_process_group("gloo")
    results: dict = {}
    sharded = mode  # fsdp or hsdp
    accum_clip = {"grad_accum_steps": 2, "max_grad_norm": 0.05}
    for name, training in (("plain", {}), ("accum_clip", accum_clip)):
        train(out / f"ddp_{name}", "ddp", **training)
        trainer = train(out / f"{sharded}_{name}", sharded, **training)
    params = local_bytes(trainer.module.parameters())
    optim = local_bytes(
        t
        for state in trainer.optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    results["param_bytes"], results["optimizer_bytes"] = params, optim
    results["units"] = trainer.parallel.units
    if mode == "fsdp":
        # Activation checkpointing and compile, each against the plain runs above.
        train(out / "ddp_full_ac", "ddp", activation_checkpointing="full")
        train(out / "fsdp_selective_ac", sharded, activation_checkpointing="selective")
        train(out / "fsdp_compiled", sharded, compile="blocks", activation_checkpointing="selective")
        # The whole forward compiled with fully checkpointed blocks, accumulation and clipping.
        train(out / "ddp_compiled", "ddp", compile="model", activation_checkpointing="full", **accum_clip)
        train(out / "parted", sharded, stop_at_step=3)
        train(out / "parted", sharded)  # resumes from step-3
        # One run.dir, two strategies: DDP to step 4, resumed under FSDP to the end (and the reverse).
        train(out / "ddp_then_fsdp", "ddp", stop_at_step=4)
        train(out / "ddp_then_fsdp", sharded)
        train(out / "fsdp_then_ddp", sharded, stop_at_step=4)
        train(out / "fsdp_then_ddp", "ddp")
        for name, units in (
            ("bad_units", ["Nowhere"]),
            ("tied_units", ["Linear"]),
            ("container_units", ["ModuleList"]),
        ):
            try:
                cfg = config(out / name, "fsdp")
                cfg.model.blocks = units
                dtrain.Trainer(cfg, model=model(), train_data=tokens(96, 0)).setup()
            except DtrainError as exc:
                results[name] = str(exc)
    if dist.get_rank() == 0:
        (out / "results.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
