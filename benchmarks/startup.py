"""What a user waits for before training starts: the quick start's job against a bare torchrun script.

    python benchmarks/startup.py --rounds 7

"dtrain" is `dtrain run examples/digits_mlp.toml --nproc 2 training.max_steps=1` in a fresh run.dir:
the launcher's checks, two workers, the digits data, DDP, one step, then its end (the eval, the final
weights, the end's checkpoint, TensorBoard). "bare" is what a careful script does at the least:
`torchrun --nproc-per-node 2 startup_bare.py` imports torch, joins gloo, wraps the same
64→1024→10 MLP in DDP and takes one step. Each round runs both, alternating (A, B, A, B, ...) so
machine noise hits both alike; the table reports the median seconds to the first step (the line
`step 1 |`, or the bare script's `step 1`) and to the command's end, and dtrain's ratio to bare.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def command(variant: str, run_dir: Path) -> list[str]:
    if variant == "dtrain":
        job = [str(ROOT / "examples" / "digits_mlp.toml"), "--nproc", "2", "training.max_steps=1", f"run.dir={run_dir}"]
        return [sys.executable, "-m", "dtrain", "run", *job]
    bare = str(HERE / "startup_bare.py")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", bare]


def once(variant: str, scratch: Path) -> tuple[float, float]:
    """Seconds from the command's start to its first step's line, and to its end."""
    run_dir = Path(tempfile.mkdtemp(prefix="startup-", dir=scratch))
    start = time.perf_counter()
    first = None
    with subprocess.Popen(
        command(variant, run_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    ) as proc:
        assert proc.stdout is not None
        said = []
        for line in proc.stdout:
            said.append(line)
            if first is None and line.startswith("step 1"):
                first = time.perf_counter() - start
        status = proc.wait()
    end = time.perf_counter() - start
    if status != 0 or first is None:
        sys.exit(f"{variant} failed (status {status}):\n{''.join(said)}")
    return first, end


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    variants = ("dtrain", "bare")
    firsts: dict[str, list[float]] = {v: [] for v in variants}
    ends: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in variants:  # warm-up (file caches, compiled bytecode), untimed
            once(variant, Path(tmp))
        for _ in range(args.rounds):
            for variant in variants:
                first, end = once(variant, Path(tmp))
                firsts[variant].append(first)
                ends[variant].append(end)
    med_first = {v: statistics.median(firsts[v]) for v in variants}
    med_end = {v: statistics.median(ends[v]) for v in variants}
    print(f"{args.rounds} rounds, {os.cpu_count()} cores; medians")
    print("| variant | to the first step | the whole command |")
    print("| --- | ---: | ---: |")
    for v in variants:
        print(f"| {v} | {med_first[v]:.2f} s | {med_end[v]:.2f} s |")
    first_ratio, end_ratio = med_first["dtrain"] / med_first["bare"], med_end["dtrain"] / med_end["bare"]
    print(f"| dtrain ÷ bare | {first_ratio:.2f}× | {end_ratio:.2f}× |")


if __name__ == "__main__":
    main()
