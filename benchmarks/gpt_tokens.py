"""Workload W2: tokens/s of the built-in GPT on the standard library's tokens under dtrain, a careful
hand-written nanoGPT-style DDP loop, and Hugging Face Accelerate.

    pip install -e '.[bench]'                         # accelerate, for its variant
    python benchmarks/gpt_tokens.py                   # 3 rounds, 20 steps each, 2 processes
    python benchmarks/gpt_tokens.py --rounds 5 --steps 40 --data data/stdlib

The model: 4 layers, 4 heads, 256 wide, block 256, batch 8 windows per process, AdamW, fp32 (on a GPU
machine: one GPU per process over nccl). The data: `dtrain prepare text --python-stdlib` (made into
--data first if it is not there). Variants run interleaved (A, B, C, A, B, C, ...) from this one
parent process, so a noisy neighbour slows all of them alike; the table reports medians and ratios.
Timing covers the training call only, after a few untimed warm-up steps in the same process.

- dtrain: `dtrain.Trainer(...).fit()` with its defaults (logging every 10 steps, TensorBoard and
  metrics.jsonl on, the hang watchdog, the step-time breakdown).
- plain: nanoGPT's loop: windows read from the memory-mapped shard, DDP, AdamW, the same global order.
- accelerate: `Accelerator().prepare(model, optimizer, DataLoader(...))` and `accelerator.backward`
  (`Accelerator(cpu=True)` without GPUs: otherwise it does not synchronise the processes at all).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import ratio_table, run_workers

VARIANTS = ("dtrain", "plain", "accelerate")
BLOCK, BATCH, LR, SEED = 256, 8, 3e-4, 0
SIZE = {"n_layer": 4, "n_head": 4, "n_embd": 256}
WARMUP_STEPS = 3


def device():
    import os

    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def model(vocab: int):
    import torch

    from dtrain.models.gpt import GPT

    torch.manual_seed(SEED)
    return GPT(vocab, BLOCK, **SIZE).to(device())


def run_dtrain(data: Path, steps: int, scratch: Path) -> float:
    import dtrain
    from dtrain.data.tokens import TokenWindows

    windows = TokenWindows(data, "train", BLOCK)
    config = dtrain.Config.from_dict(
        {
            "run": {"dir": tempfile.mkdtemp(prefix="dtrain-bench-", dir=scratch), "seed": SEED},
            "data": {"batch_size": BATCH},
            "optimizer": {"name": "adamw", "lr": LR},
            "training": {"epochs": 1, "max_steps": steps},
            # Throughput, as the hand-written loops measure it: they keep no end-of-run checkpoint either.
            "checkpoint": {"at_end": False},
        }
    )
    trainer = dtrain.Trainer(config, model=model(windows.vocab_size), train_data=windows)
    start = time.perf_counter()
    trainer.fit()
    return time.perf_counter() - start


def run_plain(data: Path, steps: int) -> float:
    """nanoGPT's train.py, less its extras: memory-mapped windows, DDP, AdamW."""
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    meta = json.loads((data / "meta.json").read_text())
    tokens = np.memmap(data / meta["splits"]["train"]["files"][0], dtype=meta["dtype"], mode="r")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = device()
    start = time.perf_counter()
    net = DDP(model(meta["vocab_size"]), device_ids=[dev.index] if dev.type == "cuda" else None)
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR)
    n = (len(tokens) - 1) // BLOCK
    order = torch.randperm(n, generator=torch.Generator().manual_seed(SEED))
    offsets = np.arange(BLOCK + 1)
    for step in range(steps):
        first = (step * world + rank) * BATCH
        idx = order[first : first + BATCH].numpy() * BLOCK
        window = torch.from_numpy(tokens[idx[:, None] + offsets].astype(np.int64)).to(dev, non_blocking=True)
        x, y = window[:, :-1], window[:, 1:]
        logits = net(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    dist.barrier()
    return time.perf_counter() - start


def run_accelerate(data: Path, steps: int) -> float:
    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from dtrain.data.tokens import TokenWindows

    windows = TokenWindows(data, "train", BLOCK)
    start = time.perf_counter()
    # Without GPUs Accelerate trains each process alone (DistributedType.NO, no gradient exchange) unless
    # told cpu=True, which gives it DDP over gloo (MULTI_CPU), as `accelerate launch --multi_cpu` does.
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    assert accelerator.num_processes == 1 or accelerator.distributed_type != "NO", accelerator.distributed_type
    net = model(windows.vocab_size)
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR)
    loader = DataLoader(windows, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(SEED))
    net, optimizer, loader = accelerator.prepare(net, optimizer, loader)
    done = 0
    while done < steps:
        for x, y in loader:
            logits = net(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            done += 1
            if done == steps:
                break
    accelerator.wait_for_everyone()
    return time.perf_counter() - start


def worker(variant: str, data: Path, steps: int, out: Path) -> None:
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(device())
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    train = {
        "dtrain": lambda d, s: run_dtrain(d, s, scratch=out.parent),
        "plain": run_plain,
        "accelerate": run_accelerate,
    }[variant]
    train(data, WARMUP_STEPS)
    dist.barrier()
    seconds = train(data, steps)
    rank, world = dist.get_rank(), dist.get_world_size()
    if dist.is_initialized():
        dist.destroy_process_group()
    if rank == 0:
        out.write_text(json.dumps({"tokens_per_s": steps * BATCH * BLOCK * world / seconds, "seconds": seconds}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--data", type=Path, default=Path("data/stdlib"), help="a `dtrain prepare` folder")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.data, args.steps, args.out)
        return
    if not (args.data / "meta.json").exists():
        subprocess.run(
            [sys.executable, "-m", "dtrain", "prepare", "text", "--python-stdlib", "--out", str(args.data)], check=True
        )
    results: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for round_ in range(args.rounds):
        for variant in VARIANTS:
            results[variant].append(
                run_workers(
                    __file__,
                    "--worker",
                    variant,
                    "--data",
                    str(args.data.absolute()),
                    "--steps",
                    str(args.steps),
                    nproc=args.nproc,
                )["tokens_per_s"]
            )
            print(
                f"round {round_ + 1}/{args.rounds} {variant}: {results[variant][-1]:,.0f} tokens/s",
                file=sys.stderr,
                flush=True,
            )
    print(ratio_table(results, "tokens/s", {"plain loop": "plain", "Accelerate": "accelerate"}))


if __name__ == "__main__":
    main()
