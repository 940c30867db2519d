"""What watching a run costs: dtrain with its monitoring on (the default) against the same run with it off.

    python benchmarks/monitor_overhead.py               # 9 rounds of 300 steps, 2 processes

"Monitored" is the default: the step-time breakdown (four marks per step, a timing comm hook, the
per-rank gather at every log step, FLOP count, straggler check) and the hang watchdog thread.
"Bare" sets monitor.breakdown=false and distributed.hang_timeout_s=0. Both train the guide's
784→1024→10 MLP, batch 64 per process, in the same 2 processes, alternating (A, B, A, B, ...) so
that machine noise hits both alike; the table reports medians and the overhead ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from harness import run_workers

VARIANTS = {
    "monitored": {},
    "bare": {"monitor": {"breakdown": False}, "distributed": {"hang_timeout_s": 0}},
}


def worker(out: Path, rounds: int, steps: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.utils.data import TensorDataset

    import dtrain
    from dtrain.models import mlp

    dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (60_000, 1, 28, 28), dtype=torch.uint8, generator=g).float().div_(255)
    y = torch.randint(0, 10, (60_000,), generator=g)
    data = TensorDataset(x, y)

    def once(name: str, n: int) -> float:
        raw = {
            "run": {"dir": tempfile.mkdtemp(prefix="monitor-bench-", dir=out.parent)},
            "data": {"batch_size": 64},
            "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.0},
            "training": {"epochs": 100, "max_steps": n},
            "checkpoint": {"at_end": False},  # the steps are measured, not the run's end
        }
        raw.update(VARIANTS[name])
        torch.manual_seed(0)
        trainer = dtrain.Trainer(dtrain.Config.from_dict(raw), model=mlp((1, 28, 28), 10), train_data=data)
        trainer.setup()  # set-up is the same for both and happens once per run: time the steps
        dist.barrier()
        start = time.perf_counter()
        trainer.fit()
        return n * 64 * dist.get_world_size() / (time.perf_counter() - start)

    for name in VARIANTS:  # warm-up, untimed
        once(name, 20)
    results = {name: [] for name in VARIANTS}
    for _ in range(rounds):
        for name in VARIANTS:
            results[name].append(once(name, steps))
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.out, args.rounds, args.steps)
        return
    results = run_workers(__file__, "--worker", "--rounds", str(args.rounds), "--steps", str(args.steps))
    med = {name: statistics.median(r) for name, r in results.items()}
    # Per round, monitored / bare: pairs taken side by side cancel slow drifts of the machine.
    ratios = [m / b for m, b in zip(results["monitored"], results["bare"])]
    print("| variant | median samples/s | rounds |")
    print("| --- | ---: | ---: |")
    for name in VARIANTS:
        print(f"| {name} | {med[name]:,.0f} | {len(results[name])} |")
    print(
        f"\nmonitoring overhead: {1 - statistics.median(ratios):+.1%} of throughput "
        f"(median of per-round ratios; range {1 - max(ratios):+.1%} to {1 - min(ratios):+.1%})"
    )


if __name__ == "__main__":
    main()
