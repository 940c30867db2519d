"""Samples/s of the guide's model under dtrain, a hand-written DDP loop and the guide's own script.

    python benchmarks/throughput.py                 # 3 rounds, 300 steps each, 2 processes
    python benchmarks/throughput.py --rounds 5 --steps 400

Each variant trains the 784→1024→10 MLP with batch 64 per process on 60 000 MNIST-shaped samples
generated on the fly, in 2 processes started by torchrun (on a GPU machine, one GPU each over nccl;
`--nproc 1` measures one GPU). Variants run interleaved (A, B, C, A, B,
C, ...) from this one parent process, so a noisy neighbour slows all of them alike; the table
reports medians and ratios. Timing covers the training call only (model wrap, optimizer, the steps),
after data is in memory and the group is up — the same span for every variant. Each worker first runs
its variant for a few warm-up steps untimed: a fresh process spends seconds on its first step (kernel
selection, connections, allocator), which would otherwise swamp the comparison.

- dtrain: `dtrain.Trainer(...).fit()` with its defaults (logging every 10 steps, TensorBoard and
  metrics.jsonl on).
- plain: a careful hand-written loop: tensors in memory, DistributedSampler's order, each batch
  gathered by index in one call, DDP, SGD.
- ceiling: the plain loop's forward, backward and SGD step with no gradient exchange at all — not
  data-parallel training, just the bound no all-reduce can beat on this machine.
- guide: the guide's script as written: a data set that turns each sample into a PIL image and
  applies ToTensor (as torchvision's MNIST does), DataLoader + DistributedSampler, DDP, SGD.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from harness import ratio_table, run_workers

VARIANTS = ("dtrain", "plain", "guide", "ceiling")
N_SAMPLES, BATCH, LR = 60_000, 64, 0.01
WARMUP_STEPS = 20


# --- workers (run under torchrun) -------------------------------------------------------------


def make_data(seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (N_SAMPLES, 28, 28), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, 10, (N_SAMPLES,), generator=g)
    return images, labels


def guide_model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 10)).to(device())


def device():
    """This worker's GPU where there are GPUs (as dtrain binds it), else the CPU."""
    import os

    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def ddp(model):
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = device()
    return DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)


def run_dtrain(images, labels, steps: int, scratch: Path) -> float:
    import torch
    from torch.utils.data import TensorDataset

    import dtrain
    from dtrain.models import mlp

    x = images.unsqueeze(1).float().div_(255)
    torch.manual_seed(0)
    model = mlp((1, 28, 28), 10)
    config = dtrain.Config.from_dict(
        {
            "run": {"dir": tempfile.mkdtemp(prefix="dtrain-bench-", dir=scratch)},
            "data": {"batch_size": BATCH},
            "optimizer": {"name": "sgd", "lr": LR, "momentum": 0.0},
            "training": {"epochs": 100, "max_steps": steps},
            # Throughput, as the hand-written loops measure it: they keep no end-of-run checkpoint either.
            "checkpoint": {"at_end": False},
        }
    )
    trainer = dtrain.Trainer(config, model=model, train_data=TensorDataset(x, labels))
    start = time.perf_counter()
    trainer.fit()
    return time.perf_counter() - start


def run_plain(images, labels, steps: int, exchange_gradients: bool = True) -> float:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DistributedSampler

    x, labels = images.unsqueeze(1).float().div_(255).to(device()), labels.to(device())
    start = time.perf_counter()
    model = ddp(guide_model()) if exchange_gradients else guide_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    sampler = DistributedSampler(range(N_SAMPLES), shuffle=True, seed=0)
    done, epoch = 0, 0
    while done < steps:
        sampler.set_epoch(epoch)
        order = torch.tensor(list(sampler), device=device())
        for idx in order.split(BATCH):
            xb, yb = x.index_select(0, idx), labels.index_select(0, idx)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(xb.view(xb.size(0), -1)), yb)
            loss.backward()
            optimizer.step()
            done += 1
            if done == steps:
                break
        epoch += 1
    dist.barrier()
    return time.perf_counter() - start


def to_tensor(pic):
    """torchvision.transforms.ToTensor for a grayscale PIL image (or a uint8 array without Pillow)."""
    import numpy as np
    import torch

    array = np.array(pic, np.uint8, copy=True)
    img = torch.from_numpy(array).view(array.shape[0], array.shape[1], 1)
    return img.permute((2, 0, 1)).contiguous().to(dtype=torch.float32).div(255)


def run_guide(images, labels, steps: int) -> float:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, Dataset, DistributedSampler

    try:
        from PIL import Image
    except ImportError:  # Pillow absent: keep the per-sample array work, skip the PIL wrapper
        Image = None

    class MNISTLike(Dataset):
        """What torchvision.datasets.MNIST does per sample: uint8 → PIL image → transform."""

        def __init__(self, data, targets, transform):
            self.data, self.targets, self.transform = data, targets, transform

        def __len__(self):
            return len(self.data)

        def __getitem__(self, index):
            img, target = self.data[index], int(self.targets[index])
            img = Image.fromarray(img.numpy(), mode="L") if Image else img.numpy()
            return self.transform(img), target

    dataset = MNISTLike(images, labels, to_tensor)
    start = time.perf_counter()
    model = ddp(guide_model())
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    done, epoch = 0, 0
    while done < steps:
        sampler.set_epoch(epoch)
        for data, target in loader:
            data, target = data.to(device()), target.to(device())
            optimizer.zero_grad()
            output = model(data.view(data.size(0), -1))
            loss = F.cross_entropy(output, target)
            loss.backward()
            optimizer.step()
            done += 1
            if done == steps:
                break
        epoch += 1
    torch.distributed.barrier()
    return time.perf_counter() - start


def worker(variant: str, steps: int, out: Path) -> None:
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(device())  # as dtrain binds it: collectives and contexts on this GPU only
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    images, labels = make_data()
    # dtrain's run directories go beside the result file, which the parent removes afterwards.
    train = {
        "dtrain": lambda *a: run_dtrain(*a, scratch=out.parent),
        "plain": run_plain,
        "guide": run_guide,
        "ceiling": lambda *a: run_plain(*a, exchange_gradients=False),
    }[variant]
    train(images, labels, WARMUP_STEPS)
    dist.barrier()
    seconds = train(images, labels, steps)
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    if rank == 0:
        out.write_text(json.dumps({"samples_per_s": steps * BATCH * world / seconds, "seconds": seconds}))


# --- the parent: interleave, collect, tabulate -----------------------------------------------


def measure(variant: str, steps: int, nproc: int) -> float:
    return run_workers(__file__, "--worker", variant, "--steps", str(steps), nproc=nproc)["samples_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.out)
        return

    results: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for round_ in range(args.rounds):
        for variant in VARIANTS:
            results[variant].append(measure(variant, args.steps, args.nproc))
            print(
                f"round {round_ + 1}/{args.rounds} {variant}: {results[variant][-1]:,.0f} samples/s",
                file=sys.stderr,
                flush=True,
            )
    print(ratio_table(results, "samples/s", {"plain loop": "plain", "guide's script": "guide"}))


if __name__ == "__main__":
    main()
