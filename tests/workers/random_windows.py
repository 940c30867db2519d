"""Run under torchrun with 2 processes: the built-in GPT on token windows at random offsets
(data.sampling = random), three times in the same processes — unbroken, stopped after step 5
(training.stop_at_step), resumed from that checkpoint. Each rank records the inputs of every micro-batch
it trains.

    torchrun --standalone --nproc-per-node 2 random_windows.py TOKENS_DIR OUT_DIR

Rank 0 writes OUT_DIR/results.json: per run, the logged per-step losses and every rank's inputs.
`write_tokens` makes the small token folder (also for the one-process nanoGPT parity test).
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import dtrain
from dtrain.data.tokens import TokenWindows
from dtrain.models.gpt import GPT

BLOCK, BATCH, ACCUM, STEPS, SEED, VOCAB = 16, 4, 2, 12, 5, 64
SIZE = {"n_layer": 2, "n_head": 2, "n_embd": 32}


def write_tokens(folder: Path, train_tokens: int = 4000, val_tokens: int = 800) -> Path:
    """A token folder of one training and one held-out file: a noisy sequence a GPT learns quickly
    (each token mostly follows from the one before)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    splits = {}
    for split, n in (("train", train_tokens), ("val", val_tokens)):
        ids = np.empty(n, dtype=np.uint16)
        ids[0] = 1
        for i in range(1, n):
            ids[i] = (ids[i - 1] * 5 + 3) % VOCAB if rng.random() < 0.8 else rng.integers(VOCAB)
        ids.tofile(folder / f"{split}-00000.bin")
        splits[split] = {"files": [f"{split}-00000.bin"], "tokens": n}
    meta = {"format": "dtrain-tokens", "version": 1, "dtype": "uint16", "vocab_size": VOCAB, "eot_token": 0}
    (folder / "meta.json").write_text(json.dumps({**meta, "tokenizer": "bytes", "splits": splits}))
    return folder


def config_for(folder: Path, run_dir: Path, stop_at: int = 0, steps: int = STEPS) -> dtrain.Config:
    return dtrain.Config.from_dict(
        {
            "run": {"dir": str(run_dir), "seed": SEED},
            "data": {
                "name": "tokens",
                "path": str(folder),
                "block_size": BLOCK,
                "batch_size": BATCH,
                "sampling": "random",
            },
            "optimizer": {"name": "adamw", "lr": 3e-3, "weight_decay": 0.1},
            "scheduler": {"name": "cosine", "warmup_steps": 2},
            "training": {"max_steps": steps, "log_every": 1, "grad_accum_steps": ACCUM, "stop_at_step": stop_at},
        }
    )


def train(folder: Path, run_dir: Path, stop_at: int = 0) -> tuple[list[float], list[list[list[int]]]]:
    config = config_for(folder, run_dir, stop_at)
    seen: list[list[int]] = []

    def step(model, batch):
        x, y = batch
        seen.append(x.tolist())
        logits = model(x)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    torch.manual_seed(SEED)
    data = TokenWindows(folder, "train", BLOCK)
    dtrain.Trainer(config, model=GPT(VOCAB, BLOCK, **SIZE), train_data=data, step_fn=step).fit()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    everyone: list[list[list[int]]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, seen)
    return [r["loss"] for r in records if "loss" in r], everyone


def main(folder: Path, out: Path) -> None:
    dist.init_process_group("gloo")
    unbroken = train(folder, out / "unbroken")
    stopped = train(folder, out / "stopped", stop_at=5)
    resumed = train(folder, out / "stopped")
    if dist.get_rank() == 0:
        (out / "results.json").write_text(json.dumps({"unbroken": unbroken, "stopped": stopped, "resumed": resumed}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
