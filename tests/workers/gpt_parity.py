"""Run under torchrun with 2 processes: the built-in GPT on token windows, trained by dtrain and by a
hand-written nanoGPT-style DDP loop — same init, same windows in the same order, same AdamW.

    torchrun --standalone --nproc-per-node 2 gpt_parity.py TOKENS_DIR OUT_DIR

The hand loop orders the windows itself (the epoch's permutation cut into global batches, each rank a
contiguous slice: the order dtrain promises, written out independently) and reads them straight from
the .bin file. Rank 0 writes OUT_DIR/results.json: both loops' per-step losses (mean over ranks).
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import dtrain
from dtrain.data.tokens import TokenWindows
from dtrain.models.gpt import GPT

BLOCK, BATCH, STEPS, SEED, LR = 32, 4, 12, 3, 3e-3
SIZE = {"n_layer": 2, "n_head": 2, "n_embd": 32}


def hand_written(folder: Path, vocab: int) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    meta = json.loads((folder / "meta.json").read_text())
    tokens = np.fromfile(folder / meta["splits"]["train"]["files"][0], dtype=np.uint16).astype(np.int64)
    n = (len(tokens) - 1) // BLOCK
    torch.manual_seed(SEED)
    model = DDP(GPT(vocab, BLOCK, **SIZE))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(SEED + 0))  # epoch 0
    losses = []
    for step in range(STEPS):
        start = step * BATCH * world + rank * BATCH
        windows = torch.stack(
            [torch.from_numpy(tokens[i * BLOCK : i * BLOCK + BLOCK + 1]) for i in order[start : start + BATCH].tolist()]
        )
        x, y = windows[:, :-1], windows[:, 1:]
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def with_dtrain(folder: Path, out: Path) -> list[float]:
    config = dtrain.Config.from_dict(
        {
            "run": {"dir": str(out / "dtrain"), "seed": SEED},
            "data": {"name": "tokens", "path": str(folder), "block_size": BLOCK, "batch_size": BATCH},
            "optimizer": {"name": "adamw", "lr": LR, "weight_decay": 0.0},
            "training": {"epochs": 1, "max_steps": STEPS, "log_every": 1},
        }
    )
    torch.manual_seed(SEED)
    model = GPT(TokenWindows(folder, "train", BLOCK).vocab_size, BLOCK, **SIZE)
    dtrain.Trainer(config, model=model, train_data=TokenWindows(folder, "train", BLOCK)).fit()
    records = [json.loads(line) for line in (out / "dtrain" / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def main(folder: Path, out: Path) -> None:
    dist.init_process_group("gloo")
    vocab = json.loads((folder / "meta.json").read_text())["vocab_size"]
    results = {"hand": hand_written(folder, vocab), "dtrain": with_dtrain(folder, out)}
    if dist.get_rank() == 0:
        (out / "results.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
