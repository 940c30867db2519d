"""Workload W2 under each way of spreading the model: tokens/s and what each rank holds, for dtrain with
DDP, FSDP2, FSDP2 + activation checkpointing, FSDP2 keeping gathered parameters from forward to backward
(reshard_after_forward = false, "zero2"), compile, tensor parallel (alone; under FSDP from 4 processes),
pipeline parallel under each schedule (4 micro-batches a step: its bubble is reported), and Hugging Face
Accelerate (its FSDP2 on GPUs; its FSDP needs an accelerator, so on CPUs its DDP).

    pip install -e '.[bench]'                       # accelerate, for its variant
    python benchmarks/sharding.py                   # 3 rounds, 25 steps each, 2 processes
    python benchmarks/sharding.py --rounds 5 --steps 40 --data data/stdlib

The model and data are W2's (benchmarks/gpt_tokens.py: the built-in GPT, 4 layers, 4 heads, 256 wide,
block 256, 8 windows per process, AdamW, fp32, the standard library's tokens). Variants run interleaved
from this one parent process (A, B, C, ... A, B, C); the table gives medians and ratios.

Throughput is steady state, measured the same way for every variant: the steps after the first
`--log-every` (warm-up: the allocator, and for compile the compilation itself) — for dtrain from its own
tokens_per_s records, for Accelerate by the clock around those same steps. Memory is the most any rank
holds in parameters, gradients and optimizer state, measured from the tensors (a DTensor's local shard
only): for dtrain from its metrics.jsonl, for Accelerate after its first step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from gpt_tokens import BATCH, BLOCK, LR, SEED, model
from harness import ratio_table, run_workers

VARIANTS = {  # name → dtrain settings (None: Accelerate)
    "ddp": {},
    "fsdp": {"parallel": {"strategy": "fsdp"}},
    "fsdp+ac": {"parallel": {"strategy": "fsdp"}, "training": {"activation_checkpointing": "selective"}},
    "fsdp-zero2": {"parallel": {"strategy": "fsdp", "reshard_after_forward": False}},
    "ddp+compile": {"training": {"compile": "blocks"}},
    "fsdp+compile": {"parallel": {"strategy": "fsdp"}, "training": {"compile": "blocks"}},
    "tp": {"parallel": {"tp_size": 2}},  # with 2 processes: tp 2 alone
    "fsdp+tp": {"parallel": {"strategy": "fsdp", "tp_size": 2}},  # from 4 processes: fsdp N/2 × tp 2
    # Pipeline stages over 4 accumulation micro-batches (a step then trains 4 × the windows of the others).
    "pp-gpipe": {"parallel": {"pp_size": 2, "pp_schedule": "gpipe"}, "training": {"grad_accum_steps": 4}},
    "pp-1f1b": {"parallel": {"pp_size": 2, "pp_schedule": "1f1b"}, "training": {"grad_accum_steps": 4}},
    "pp-interleaved": {
        "parallel": {"pp_size": 2, "pp_schedule": "interleaved_1f1b"},
        "training": {"grad_accum_steps": 4},
    },
    "accelerate": None,  # FSDP2 on GPUs; on CPUs its DDP (see run_accelerate)
}
NEEDS_FOUR = {"fsdp+tp"}  # on 2 processes it would be tp alone


def run_dtrain(settings: dict, data: Path, steps: int, log_every: int, scratch: Path) -> dict:
    import dtrain
    from dtrain.data.tokens import TokenWindows

    windows = TokenWindows(data, "train", BLOCK)
    run_dir = scratch / "run"  # the same on every rank: rank 0 writes it
    config = dtrain.Config.from_dict(
        {
            "run": {"dir": str(run_dir), "seed": SEED},
            "data": {"batch_size": BATCH},
            "optimizer": {"name": "adamw", "lr": LR},
            "parallel": settings.get("parallel", {}),
            "training": {"epochs": 1, "max_steps": steps, "log_every": log_every, **settings.get("training", {})},
        }
    )
    dtrain.Trainer(config, model=model(windows.vocab_size), train_data=windows).fit()
    if int(os.environ["RANK"]) != 0:
        return {}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "tokens_per_s" in r]
    first = train[0]
    held = max(p + g + o for p, g, o in zip(first["param_bytes"], first["grad_bytes"], first["optimizer_bytes"]))
    result = {"tokens_per_s": statistics.mean(r["tokens_per_s"] for r in train[1:]), "held_bytes": held}
    if "pp_bubble" in first:  # the schedule's idle share in theory (benchmarks/bubble.py measures it)
        result["pp_bubble"] = first["pp_bubble"]
    return result


def run_accelerate(data: Path, steps: int, log_every: int) -> dict:
    """Accelerate's FSDP2 (`fsdp_version=2`), the GPT's blocks wrapped by class name, as its docs show.
    Its FSDP needs an accelerator (on CPUs Accelerate gives multi-process jobs DDP, MULTI_CPU, whatever
    plugin it is handed): without GPUs this is Accelerate's DDP."""
    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from torch.utils.data import DataLoader

    from dtrain.data.tokens import TokenWindows
    from dtrain.observe.memory import gradient_bytes, state_bytes

    windows = TokenWindows(data, "train", BLOCK)
    gpus = torch.cuda.is_available()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"],
        reshard_after_forward=True,
    )
    accelerator = Accelerator(fsdp_plugin=plugin if gpus else None, cpu=not gpus)
    net = model(windows.vocab_size)
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR)
    loader = DataLoader(windows, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(SEED))
    net, optimizer, loader = accelerator.prepare(net, optimizer, loader)
    done, grads, start = 0, 0, 0.0
    while done < steps:
        for x, y in loader:
            if done == log_every:
                accelerator.wait_for_everyone()
                start = time.perf_counter()
            logits = net(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
            accelerator.backward(loss)
            grads = grads or gradient_bytes(net)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            done += 1
            if done == steps:
                break
    loss.item()  # the last step's work is done
    seconds = time.perf_counter() - start
    params, state = state_bytes(net, optimizer)
    world = accelerator.num_processes
    return {
        "tokens_per_s": (steps - log_every) * BATCH * BLOCK * world / seconds,
        "held_bytes": max(accelerator.gather(torch.tensor([params + grads + state])).tolist()),
        "how": str(accelerator.distributed_type),
    }


def worker(variant: str, data: Path, steps: int, log_every: int, out: Path) -> None:
    import torch.distributed as dist

    settings = VARIANTS[variant]
    if settings is None:
        result = run_accelerate(data, steps, log_every)
    else:
        dist.init_process_group("gloo")
        result = run_dtrain(settings, data, steps, log_every, scratch=out.parent)
    rank = dist.get_rank()
    if dist.is_initialized():
        dist.destroy_process_group()
    if rank == 0:
        out.write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=25, help="optimizer steps per run")
    parser.add_argument("--log-every", type=int, default=5, help="warm-up steps, and steps per measured window")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--variants", default="", help="comma-separated, from: " + ", ".join(VARIANTS))
    parser.add_argument("--data", type=Path, default=Path("data/stdlib"), help="a `dtrain prepare` folder")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.data, args.steps, args.log_every, args.out)
        return
    if not (args.data / "meta.json").exists():
        subprocess.run(
            [sys.executable, "-m", "dtrain", "prepare", "text", "--python-stdlib", "--out", str(args.data)], check=True
        )
    chosen = (
        args.variants.split(",") if args.variants else [v for v in VARIANTS if args.nproc >= 4 or v not in NEEDS_FOUR]
    )
    speed: dict[str, list[float]] = {v: [] for v in chosen}
    held: dict[str, list[float]] = {v: [] for v in chosen}
    bubble: dict[str, float] = {}
    for round_ in range(args.rounds):
        for variant in chosen:
            result = run_workers(
                __file__,
                "--worker",
                variant,
                "--data",
                str(args.data.absolute()),
                "--steps",
                str(args.steps),
                "--log-every",
                str(args.log_every),
                nproc=args.nproc,
            )
            speed[variant].append(result["tokens_per_s"])
            held[variant].append(result["held_bytes"])
            if "pp_bubble" in result:
                bubble[variant] = result["pp_bubble"]
            print(
                f"round {round_ + 1}/{args.rounds} {variant}: {result['tokens_per_s']:,.0f} tokens/s, "
                f"{result['held_bytes'] / 2**20:.1f} MiB held per rank {result.get('how', '')}",
                file=sys.stderr,
                flush=True,
            )
    baseline = "ddp" if "ddp" in chosen else chosen[0]
    table = ratio_table(speed, "tokens/s", {baseline: baseline}).splitlines()
    base = statistics.median(held[baseline])
    print(table[0] + f" MiB held per rank | vs {baseline} | bubble (theory) |")
    print(table[1] + " ---: | ---: | ---: |")
    for variant, row in zip(chosen, table[2:]):
        mib = statistics.median(held[variant])
        idle = f"{bubble[variant]:.0%}" if variant in bubble else ""
        print(row + f" {mib / 2**20:.1f} | {mib / base:.2f}× | {idle} |")


if __name__ == "__main__":
    main()
