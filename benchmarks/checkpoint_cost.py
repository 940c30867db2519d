"""What a checkpoint of the main model costs, and how long a restart takes to get back to training.

    python benchmarks/checkpoint_cost.py            # 2 processes, 5 saves, 3 restarts, 4 GPT pairs
    python benchmarks/checkpoint_cost.py --device cuda   # the GPT on GPUs (pinned host copies)

- save / load: the guide's 784→1024→10 MLP with SGD momentum, 2 processes on gloo; seconds per
  checkpoint written and read back (median), and its bytes on disk.
- restart: `dtrain run ... --nproc 2 --max-restarts 1` where one worker SIGKILLs itself mid-run; the
  time from its death to the first training step the restarted group completes (torchrun noticing,
  stopping the survivor, restarting both, rendezvous, imports, resume from the newest checkpoint).
- blocked: a ~100M-parameter built-in GPT (12 layers of 768, 16,384 tokens) with AdamW, ~1.2 GB a
  checkpoint, 2 processes: how long training is blocked per checkpoint written synchronously (the
  whole write, fsynced and sealed) and with `checkpoint.async` (the copy to host memory and the small
  files; the write then goes on in the background, its time also shown), taken in turns (sync, async,
  sync, async, ...), medians and their ratio; the first async one, which also allocates the host copy
  that the next ones reuse, is shown apart.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import run_workers

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def dying_mlp(input_shape, num_classes, die_at=0, note=""):
    """The guide's MLP; in the first attempt, rank 1 SIGKILLs itself at training forward `die_at`."""
    import torch
    from torch import nn

    class Dying(nn.Sequential):
        calls = 0

        def forward(self, x):
            if self.training:
                Dying.calls += 1
                first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
                if first and os.environ.get("RANK") == "1" and Dying.calls == die_at:
                    Path(note).write_text(str(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)
            return super().forward(x)

    return Dying(
        nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), 1024), nn.ReLU(), nn.Linear(1024, num_classes)
    )


def save_load_worker(out: Path, saves: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.utils.data import TensorDataset

    import dtrain
    from dtrain.checkpoint import Position
    from dtrain.models import mlp

    dist.init_process_group("gloo")
    x, y = torch.rand(4096, 1, 28, 28), torch.randint(0, 10, (4096,))
    run_dir = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=out.parent)) if dist.get_rank() == 0 else None
    run_dir = Path(dtrain.distributed.from_rank0(str(run_dir)))
    config = dtrain.Config.from_dict(
        {"run": {"dir": str(run_dir)}, "optimizer": {"momentum": 0.9}, "training": {"epochs": 1, "max_steps": 5}}
    )
    trainer = dtrain.Trainer(config, model=mlp((1, 28, 28), 10), train_data=TensorDataset(x, y))
    trainer.fit()  # leaves the group alone: it did not create it
    save_s, load_s = [], []
    for i in range(saves):
        dist.barrier()
        start = time.perf_counter()
        checkpoint = trainer.checkpointer.save(Position(100 + i, 0))
        dist.barrier()
        save_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        trainer.checkpointer.restore(checkpoint)
        dist.barrier()
        load_s.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        size = sum(p.stat().st_size for p in checkpoint.path.rglob("*") if p.is_file())
        out.write_text(
            json.dumps({"save_s": statistics.median(save_s), "load_s": statistics.median(load_s), "bytes": size})
        )
    dist.destroy_process_group()


def blocked_worker(out: Path, pairs: int, device: str) -> None:
    """Checkpoints of a ~100M-parameter GPT with AdamW state, synchronous and in the background in turns:
    the records each one reports (training blocked, write time)."""
    import torch
    import torch.distributed as dist

    from dtrain.checkpoint import Checkpointer, Parts, Position
    from dtrain.config import CheckpointConfig
    from dtrain.distributed import from_rank0
    from dtrain.models.gpt import GPT

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    if device == "cuda":  # each process on a GPU of its own where there are enough, else they share
        device = f"cuda:{rank % torch.cuda.device_count()}"
    model = GPT(vocab_size=16384, block_size=256, n_layer=12, n_head=12, n_embd=768).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(
        torch.randint(0, 16384, (1, 16), device=device)
    ).float().mean().backward()  # AdamW's state: one step (alike on every rank)
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    parts = Parts(model, optimizer, scheduler, torch.amp.GradScaler("cpu", enabled=False), rank, world, 1)
    run_dir = Path(tempfile.mkdtemp(prefix="ckpt-gpt-", dir=out.parent)) if rank == 0 else None
    config = CheckpointConfig(keep=1)
    config.async_ = True
    checkpointer = Checkpointer(config, Path(from_rank0(str(run_dir))), parts)
    records: list[dict] = []
    checkpointer.report = records.append
    for i in range(2 * pairs):
        dist.barrier()
        checkpointer.checkpoint(Position(i + 1, 0), wait=i % 2 == 0)  # A (synchronous), B (background), ...
        checkpointer.finish(i + 1)  # B's write sealed before the next A begins: they never overlap
    if rank == 0:
        newest = checkpointer.store.newest()
        assert newest is not None
        size = sum(p.stat().st_size for p in newest.path.rglob("*") if p.is_file())
        params = sum(p.numel() for p in model.parameters())
        out.write_text(json.dumps({"records": records, "bytes": size, "params": params, "device": device}))
    dist.destroy_process_group()


def measure_restart(tmp: Path) -> float:
    note = tmp / "died_at"
    run_dir = tmp / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "dtrain",
            "run",
            "examples/digits_mlp.toml",
            "data.name=synthetic",
            "data.num_samples=20000",
            "training.epochs=1",
            "training.log_every=1",
            "checkpoint.every_steps=20",
            "model.name=checkpoint_cost:dying_mlp",
            f'model.options={{die_at = 50, note = "{note}"}}',
            "--nproc",
            "2",
            "--max-restarts",
            "1",
            f"run.dir={run_dir}",
        ],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
    )
    died = float(note.read_text())
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    back = min(m["time"] for m in lines if "loss" in m and m["time"] > died)
    return back - died


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument("--gpt-pairs", type=int, default=4, help="GPT checkpoints, synchronous and async, each")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the GPT trains")
    parser.add_argument("--worker", choices=["save-load", "blocked"], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "save-load":
        save_load_worker(args.out, args.saves)
        return
    if args.worker == "blocked":
        blocked_worker(args.out, args.gpt_pairs, args.device)
        return
    cost = run_workers(__file__, "--worker", "save-load", "--saves", str(args.saves))
    gpt = run_workers(__file__, "--worker", "blocked", "--gpt-pairs", str(args.gpt_pairs), "--device", args.device)
    restarts = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.restarts):
            case = Path(tmp) / f"restart{i}"
            case.mkdir()
            restarts.append(measure_restart(case))
    print("| what (784→1024→10 MLP, SGD momentum, 2 processes) | median |")
    print("| --- | ---: |")
    print(f"| checkpoint size on disk | {cost['bytes'] / 1e6:.1f} MB |")
    print(f"| write one checkpoint (all ranks, fsynced, sealed) | {cost['save_s']:.3f} s |")
    print(f"| read it back (verify not included) | {cost['load_s']:.3f} s |")
    print(
        f"| worker killed → restarted group trains again | {statistics.median(restarts):.1f} s "
        f"({', '.join(f'{r:.1f}' for r in restarts)}) |"
    )
    print()
    print(gpt_table(gpt))


def gpt_table(gpt: dict) -> str:
    """The GPT's rows: training blocked per checkpoint, synchronous and async, medians and their ratio."""
    sync = [r["checkpoint_blocked_s"] for r in gpt["records"] if not r["checkpoint_background"]]
    background = [r for r in gpt["records"] if r["checkpoint_background"]]
    first = background[0]["checkpoint_blocked_s"]  # also allocates the host copy, kept for the next ones
    steady = background[1:] or background
    blocked = [r["checkpoint_blocked_s"] for r in steady]
    written = [r["checkpoint_write_s"] for r in background]

    def runs(values: list[float]) -> str:
        return f"{statistics.median(values):.3f} s ({', '.join(f'{v:.3f}' for v in values)})"

    return "\n".join(
        [
            f"| what ({gpt['params'] / 1e6:.0f}M-parameter GPT, AdamW, 2 processes, {gpt['device']}) | median (runs) |",
            "| --- | ---: |",
            f"| checkpoint size on disk | {gpt['bytes'] / 1e9:.2f} GB |",
            f"| training blocked per checkpoint, synchronous | {runs(sync)} |",
            f"| training blocked per checkpoint, `checkpoint.async` (after the first) | {runs(blocked)} |",
            f"| async / synchronous | {statistics.median(blocked) / statistics.median(sync):.2f}× |",
            f"| the first `checkpoint.async` one (allocates the host copy) | {first:.3f} s |",
            f"| its write in the background, until sealed | {runs(written)} |",
        ]
    )


if __name__ == "__main__":
    main()
