"""What every benchmark here shares: run this same script as N workers under torchrun and read back
what rank 0 wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def run_workers(script: str, *args: str, nproc: int = 2, env: dict[str, str] | None = None) -> Any:
    """Run `script --out FILE args` in `nproc` workers under torchrun and return the JSON that rank 0
    wrote to FILE. FILE sits in a temporary directory that workers may also use for scratch (run
    directories); it is removed afterwards. `env` adds to this process's environment (e.g. a
    PYTHONPATH that selects which dtrain the workers import). Exits with the workers' output if they
    fail."""
    # The same threads for every variant: the cores split among the processes, as dtrain does.
    threads = os.environ.get("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // nproc)))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={nproc}",
                script,
                "--out",
                str(out),
                *args,
            ],
            env={**os.environ, "OMP_NUM_THREADS": threads, **(env or {})},
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            sys.exit(f"{os.path.basename(script)} {' '.join(args)} failed:\n{done.stderr}")
        return json.loads(out.read_text())


def ratio_table(results: dict[str, list[float]], unit: str, against: dict[str, str]) -> str:
    """Markdown: each variant's median `unit`, its runs, and its ratio to each baseline
    (`against`: column title → variant)."""
    import statistics

    med = {v: statistics.median(r) for v, r in results.items()}
    rows = [
        f"| variant | median {unit} | runs | " + " | ".join(f"vs {title}" for title in against) + " |",
        "| --- | ---: | ---: | " + " | ".join("---:" for _ in against) + " |",
    ]
    for v in results:
        ratios = " | ".join(f"{med[v] / med[base]:.2f}×" for base in against.values())
        rows.append(f"| {v} | {med[v]:,.0f} | {len(results[v])} | {ratios} |")
    return "\n".join(rows)
