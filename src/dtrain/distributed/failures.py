"""Saying a worker's failure once: to the launcher, or on rank 0's console.

Under dtrain's launcher a worker writes its failure to torchrun's per-worker error file and prints
nothing; the launcher prints the first failure once. Started by plain torchrun, srun or mpirun, rank 0
prints a bad-input line and the other ranks stay quiet; a crash prints its traceback with its rank.
Used by the worker entry (worker/) and the hang watchdog (observe/watchdog.py).
"""

from __future__ import annotations

import json
import os
import sys
import time

from dtrain.distributed import LAUNCHED_BY_DTRAIN


def record_failure(message: str, rank: int, traceback_text: str | None, alone: bool = False) -> None:
    """One failure: `message` (a line for people), or `traceback_text` for a crash. `alone`: a failure
    no other rank is there to say (its peers never came), said by this rank whatever its number."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file and os.environ.get(LAUNCHED_BY_DTRAIN):
        text = message if traceback_text is None else traceback_text.rstrip()
        with open(error_file, "w") as fh:
            json.dump({"message": text, "timestamp": int(time.time())}, fh)
        return
    if traceback_text is not None:
        sys.stderr.write(f"[rank {rank}] {traceback_text}")
    elif rank == 0 or alone:
        print(f"dtrain: error: {message}", file=sys.stderr, flush=True)
