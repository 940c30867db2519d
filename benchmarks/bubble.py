"""The pipeline bubble, measured: dtrain's pp2 under each schedule, each stage's forward and backward
work timed on real processes, its idle share of the step beside the schedule's theory.

    python benchmarks/bubble.py                         # 4 blocks, 4 micro-batches, 2 rounds
    python benchmarks/bubble.py --layers 8 --rounds 3   # more blocks: the head weighs less
    python benchmarks/bubble.py --schedules 1f1b --splits cost,count   # cut by cost or by count

dtrain's own `pp_bubble` (console, metrics.jsonl, TensorBoard, `dtrain report`) is the schedule's theory,
(p−1)/(v·m+p−1), not a measurement. Here each worker trains the built-in GPT of W2
(benchmarks/gpt_tokens.py, `--layers` blocks) with `parallel.pp_size = 2` and
`training.grad_accum_steps = --micro-batches`, and times, per optimizer step, the schedule's whole
`step` and, inside it, every stage action's forward and backward (`forward_one_chunk`,
`backward_one_chunk`, and the last stage's loss). A stage's idle share is 1 − busy / step; the table
gives the mean over the steps after the first `--warmup` and over both stages, and each stage's. What
a stage does outside those actions (waiting on sends and receives) counts as idle, as it does in the
theory, which counts only the schedule's shape. The last stage also holds the final norm, the head and
the loss: cut by count (`--splits count`) it is the slower one and the first waits on it (more idle
than theory); cut by cost (dtrain's default) it takes fewer blocks, as far as whole blocks allow — the
more blocks (`--layers`), the closer the stages' costs.
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

from gpt_tokens import BATCH, BLOCK, LR, SEED, SIZE
from harness import run_workers

SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2}  # schedule → stages per process


def timed(steps: list[dict]) -> None:
    """Time the schedule's step and each stage action (torch's pipelining, patched in this worker)."""
    from torch.distributed.pipelining import schedules, stage

    def wrap(owner: type, name: str, key: str) -> None:
        inner = getattr(owner, name)

        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if key == "step":
                    steps[-1]["step"] = time.perf_counter() - start
                    steps.append({"busy": 0.0})
                else:
                    steps[-1]["busy"] += time.perf_counter() - start

        setattr(owner, name, run)

    wrap(schedules.PipelineScheduleSingle, "step", "step")
    wrap(schedules.PipelineScheduleMulti, "step", "step")
    wrap(stage._PipelineStageBase, "forward_one_chunk", "busy")
    wrap(stage._PipelineStageBase, "backward_one_chunk", "busy")
    wrap(schedules._PipelineSchedule, "_maybe_compute_loss", "busy")  # the last stage's loss is its work


def worker(schedule: str, split: str, layers: int, micro: int, steps: int, warmup: int, data: Path, out: Path) -> None:
    import torch
    import torch.distributed as dist

    import dtrain
    from dtrain.data.tokens import TokenWindows
    from dtrain.models.gpt import GPT

    dist.init_process_group("gloo")
    record: list[dict] = [{"busy": 0.0}]
    timed(record)
    windows = TokenWindows(data, "train", BLOCK)
    config = dtrain.Config.from_dict(
        {
            "run": {"dir": str(out.parent / "run"), "seed": SEED},
            "data": {"batch_size": BATCH},
            "optimizer": {"name": "adamw", "lr": LR},
            "parallel": {"pp_size": 2, "pp_schedule": schedule, "pp_split": split},
            "training": {"epochs": 1, "max_steps": steps, "log_every": steps, "grad_accum_steps": micro},
        }
    )
    torch.manual_seed(SEED)
    model = GPT(windows.vocab_size, BLOCK, **{**SIZE, "n_layer": layers})
    dtrain.Trainer(config, model=model, train_data=windows).fit()
    done = [s for s in record if "step" in s][warmup:]
    idle = statistics.mean(1 - s["busy"] / s["step"] for s in done)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, idle)
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"idle": every, "step_s": statistics.median(s["step"] for s in done)}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the measurement")
    parser.add_argument("--layers", type=int, default=4, help="the GPT's blocks, cut into the stages")
    parser.add_argument("--micro-batches", type=int, default=4, help="training.grad_accum_steps")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="from: " + ", ".join(SCHEDULES))
    parser.add_argument("--splits", default="cost,count", help="parallel.pp_split: from cost, count")
    parser.add_argument("--data", type=Path, default=Path("data/stdlib"), help="a `dtrain prepare` folder")
    parser.add_argument("--worker", choices=SCHEDULES, help=argparse.SUPPRESS)
    parser.add_argument("--split", default="cost", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.split, args.layers, args.micro_batches, args.steps, args.warmup, args.data, args.out)
        return
    if not (args.data / "meta.json").exists():
        subprocess.run(
            [sys.executable, "-m", "dtrain", "prepare", "text", "--python-stdlib", "--out", str(args.data)], check=True
        )
    chosen = [(schedule, split) for schedule in args.schedules.split(",") for split in args.splits.split(",")]
    idle: dict[tuple[str, str], list[list[float]]] = {c: [] for c in chosen}
    for round_ in range(args.rounds):
        for schedule, split in chosen:
            result = run_workers(
                __file__,
                "--worker",
                schedule,
                "--split",
                split,
                "--layers",
                str(args.layers),
                "--micro-batches",
                str(args.micro_batches),
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
                "--data",
                str(args.data.absolute()),
                nproc=2,
            )
            idle[schedule, split].append(result["idle"])
            shares = ", ".join(f"{x:.0%}" for x in result["idle"])
            print(f"round {round_ + 1}/{args.rounds} {schedule} {split}: idle {shares}", file=sys.stderr, flush=True)
    p, m = 2, args.micro_batches
    print(f"{args.layers} blocks, {p} stages, {m} micro-batches, {args.rounds} rounds")
    print("| schedule | split | theory | measured (mean of stages, median of rounds) | spread | stage 0 | stage 1 |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for schedule, split in chosen:
        theory = (p - 1) / (SCHEDULES[schedule] * m + p - 1)
        means = [statistics.mean(r) for r in idle[schedule, split]]
        stages = [statistics.median(r[k] for r in idle[schedule, split]) for k in range(p)]
        print(
            f"| {schedule} | {split} | {theory:.0%} | {statistics.median(means):.0%} | "
            f"{min(means):.0%}–{max(means):.0%} | " + " | ".join(f"{x:.0%}" for x in stages) + " |"
        )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
