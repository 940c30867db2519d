"""Running dtrain the way users do: the real CLI, the real torchrun, real files."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"
TIMEOUT = 240  # seconds: a hung distributed test fails instead of stalling the suite
# A small synthetic job on the command line, as a user types it: `dtrain("run", *SMALL_JOB, ...)`.
# The README quick start's job, as its first command types it (tests/test_readme_commands.py holds
# the README to it).
QUICK_START = [sys.executable, "-m", "dtrain", "run", "examples/digits_mlp.toml", "--nproc", "2"]
SMALL_JOB = [
    "examples/digits_mlp.toml",
    "data.name=synthetic",
    "data.num_samples=300",
    "data.input_shape=[12]",
    "data.num_classes=3",
    "data.batch_size=16",
    "training.epochs=2",
    "training.log_every=5",
    "model.hidden_size=16",
]


def gpt_on_tokens(tokens: Path, run_dir: Path, *args: str, block: int = 32, batch: int = 4) -> list[str]:
    """The arguments of `dtrain run` for the built-in GPT (examples/gpt_stdlib.toml) on the token folder
    `tokens`, 2 processes, every step logged, no evaluation: `dtrain(*gpt_on_tokens(...))`; `args` last."""
    return [
        "run",
        "examples/gpt_stdlib.toml",
        f"data.path={tokens}",
        f"data.block_size={block}",
        f"data.batch_size={batch}",
        "training.log_every=1",
        "training.eval_every=0",
        f"run.dir={run_dir}",
        "--nproc",
        "2",
        *args,
    ]


# What a child never inherits from the test's environment: rank variables, a scheduler's, dtrain's own.
NOT_INHERITED = ("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC", "SLURM_", "OMPI_", "DTRAIN_")


def env(**extra: str) -> dict[str, str]:
    """A clean environment for a child: no inherited rank variables, tests importable."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(NOT_INHERITED)}
    e["PYTHONPATH"] = os.pathsep.join([str(WORKERS), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    e.update(extra)
    return e


def run(
    args: list[str], *, cwd: Path | None = None, extra_env: dict[str, str] | None = None, timeout: float = TIMEOUT
) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, cwd=cwd or ROOT, env=env(**(extra_env or {})), capture_output=True, text=True, timeout=timeout
    )


def dtrain(*args: str, **kwargs) -> subprocess.CompletedProcess:
    """`dtrain ARGS` as a user types it."""
    return run([sys.executable, "-m", "dtrain", *args], **kwargs)


def torchrun(script: str | Path, *args: str, nproc: int = 2, **kwargs) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node N script args` (torch's own launcher)."""
    return run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(script),
            *map(str, args),
        ],
        extra_env={"OMP_NUM_THREADS": "1"},
        **kwargs,
    )


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_lines(run_dir: Path) -> list[dict]:
    return [m for m in metrics(run_dir) if "loss" in m]


def eval_lines(run_dir: Path) -> list[dict]:
    return [m for m in metrics(run_dir) if "eval_loss" in m]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "model.safetensors"))


def assert_weights_close(a: dict, b: dict, atol: float = 1e-6, rtol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=rtol, msg=lambda m, key=key: f"{key}: {m}")


def write_idx(path: Path, array) -> None:
    """An IDX file as MNIST ships it (uint8 data, big-endian sizes)."""
    import gzip

    import numpy as np

    array = np.asarray(array, dtype=np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    payload = header + array.tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gz":
        with gzip.open(path, "wb") as fh:
            fh.write(payload)
    else:
        path.write_bytes(payload)


def fake_mnist(root: Path, n_train: int = 256, n_test: int = 64, gz: bool = True, seed: int = 0) -> Path:
    """Small MNIST-format files whose label is readable from the image (so a model can learn it)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    suffix = ".gz" if gz else ""
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, size=n)
        images = rng.integers(0, 60, size=(n, 28, 28))
        for i, label in enumerate(labels):  # a bright bar whose row encodes the digit
            images[i, 2 + 2 * label, 4:24] = 255
        write_idx(root / f"{prefix}-images-idx3-ubyte{suffix}", images)
        write_idx(root / f"{prefix}-labels-idx1-ubyte{suffix}", labels)
    return root


def mount_tmpfs(path: Path, size: str, read_only: bool = False) -> bool:
    """A small (or read-only) filesystem of the test's own at `path` (needs root); whether it worked.
    Undo with unmount(path)."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    return (
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode == 0
    )


def unmount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


# A wait said out loud (distributed.waiting): the first line 2 s into the wait, then one every
# WAIT_EVERY s; a test's timeouts are WAIT_TIMEOUT s, so the lines say "giving up in 6, 4, 2 s".
WAIT_EVERY = 2
WAIT_TIMEOUT = 8
WAIT_ENV = {"DTRAIN_WAIT_REPORT_S": str(WAIT_EVERY)}


def timed_output(args: list[str], extra_env: dict[str, str] | None = None) -> tuple[int, list[tuple[float, str]]]:
    """Run `args`; its exit status and every line it wrote (stdout and stderr together), each with the
    seconds since the start at which it came."""
    proc = subprocess.Popen(
        args, cwd=ROOT, env=env(**(extra_env or {})), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    start, lines = time.monotonic(), []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append((time.monotonic() - start, line.rstrip("\n")))
    return proc.wait(timeout=TIMEOUT), lines


def side_by_side(commands: dict) -> dict:
    """`timed_output` of each of `commands` (key → (args, extra_env)), all started at once: for commands
    that spend their seconds waiting for a peer that never comes, the waits overlap instead of adding up."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(len(commands)) as pool:
        futures = {key: pool.submit(timed_output, args, extra_env) for key, (args, extra_env) in commands.items()}
        return {key: future.result() for key, future in futures.items()}


def assert_waited_then_gave_up(lines: list[tuple[float, str]], waiting: str, give_up: str) -> None:
    """The whole output: `waiting` (a regex whose group `left` is the seconds it says are left) 2 s
    into the wait, again every WAIT_EVERY s, then the one give-up line (a regex) — nothing else."""
    text = "\n".join(line for _, line in lines)
    *waits, last = lines
    assert len(waits) >= 2 and re.fullmatch(give_up, last[1]), text
    matches = [re.fullmatch(waiting, line) for _, line in waits]
    assert all(matches), text
    left = [int(m["left"]) for m in matches if m]
    # The first line comes 2 s into the wait; each next one WAIT_EVERY s later, by the clock too.
    assert left[0] in (WAIT_TIMEOUT - 2, WAIT_TIMEOUT - 3), text
    assert all(a - b in (WAIT_EVERY - 1, WAIT_EVERY, WAIT_EVERY + 1) for a, b in zip(left, left[1:])), text
    times = [t for t, _ in waits]
    assert all(WAIT_EVERY - 1 < b - a < WAIT_EVERY + 1.5 for a, b in zip(times, times[1:])), lines
