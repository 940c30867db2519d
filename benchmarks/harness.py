"""What every benchmark here shares: start this same script as N workers under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys


def torchrun_self(script: str, *args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    """Run `script args` in `nproc` workers under torchrun; exit with its output if it fails."""
    # The same threads for every variant: the cores split among the processes, as dtrain does.
    threads = os.environ.get("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // nproc)))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={nproc}", script, *args],
                          env={**os.environ, "OMP_NUM_THREADS": threads}, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{os.path.basename(script)} {' '.join(args)} failed:\n{done.stderr}")
    return done
