"""A hang explained, not just killed.

Each rank runs a watchdog thread. Every second it publishes the rank's progress (step and phase) to
the process group's store. When the rank has made no progress for `distributed.hang_timeout_s` —
typically because one rank stalled and every other one waits for it inside a collective — it writes
every thread's Python stack to `<run.dir>/diagnostics/rank-<N>.txt` and the flight recorder's record
of the last collectives to `diagnostics/flight-recorder-rank-<N>` (nccl's own dump would come only at
the backend's timeout, long after), reads everyone's progress to name the ranks that are behind,
reports once, and ends the process well before the backend's own timeout.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dtrain.distributed.failures import record_failure
from dtrain.errors import EXIT_HANG
from dtrain.observe.steptime import Progress

# The order phases come in within a step: a rank earlier in it is further behind.
_ORDER = {
    "starting": 0,
    "waiting for data": 1,
    "forward/backward": 2,
    "gradient all-reduce": 3,
    "optimizer step": 4,
    "between steps": 5,
    "evaluation": 5,
    "checkpoint": 5,
}


class HangWatch:
    def __init__(self, progress: Progress, timeout_s: float, rank: int, world_size: int, run_dir: Path):
        self.progress = progress
        self.timeout_s = timeout_s
        self.rank = rank
        self.world_size = world_size
        self.diagnostics = Path(run_dir) / "diagnostics"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store = None
        if world_size > 1:
            # The store every rank already reaches (through rank 0), under a prefix of our own.
            try:
                self._store = dist.PrefixStore("dtrain/progress", dist.distributed_c10d._get_default_store())
            except (AttributeError, RuntimeError, ValueError):
                self._store = None  # then only this rank's own progress is known

    def start(self) -> None:
        if self.timeout_s > 0:
            self._thread = threading.Thread(target=self._run, name="dtrain-hang-watch", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        interval = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(interval):
            self._publish()
            # Writing a large checkpoint may legitimately take a while: it gets four times as long.
            limit = self.timeout_s * (4 if self.progress.phase == "checkpoint" else 1)
            if time.monotonic() - self.progress.beat > limit:
                self._on_hang()

    def _publish(self) -> None:
        if self._store is None:
            return
        try:
            self._store.set(
                str(self.rank),
                json.dumps(
                    {
                        "step": self.progress.step,
                        "phase": self.progress.phase,
                        "host": socket.gethostname(),
                        "pid": os.getpid(),
                    }
                ),
            )
        except Exception:
            pass

    def _on_hang(self) -> None:
        self.diagnostics.mkdir(parents=True, exist_ok=True)
        stack_file = self.diagnostics / f"rank-{self.rank}.txt"
        with open(stack_file, "w") as fh:
            fh.write(
                f"rank {self.rank} on {socket.gethostname()} (pid {os.getpid()}): step {self.progress.step}, "
                f"{self.progress.phase}, no progress for {self.timeout_s:g} s\n\n"
            )
            fh.flush()
            faulthandler.dump_traceback(file=fh, all_threads=True)
        dump_flight_recorder(
            self.diagnostics / f"flight-recorder-rank-{self.rank}", dist.get_backend() if dist.is_initialized() else ""
        )
        record_failure(self._describe(), self.rank, traceback_text=None)
        time.sleep(min(5.0, self.timeout_s))  # let the other ranks write their stacks too
        os._exit(EXIT_HANG)

    def _describe(self) -> str:
        seen = self._progress_of_all()
        if seen:
            position = {r: (p["step"], _ORDER.get(p["phase"], 0)) for r, p in seen.items()}
            least = min(position.values())
            behind = sorted(r for r, pos in position.items() if pos == least)
            missing = sorted(set(range(self.world_size)) - set(seen))
            ahead = sorted(set(seen) - set(behind))
            parts = [
                ", ".join(
                    f"rank {r} ({seen[r]['host']}) at step {seen[r]['step'] + 1}, {seen[r]['phase']}" for r in behind
                )
                + (" is behind" if len(behind) == 1 else " are behind")
            ]
            if ahead:
                example = seen[ahead[0]]
                parts.append(
                    f"rank(s) {', '.join(map(str, ahead))} wait at step {example['step'] + 1}, {example['phase']}"
                )
            if missing:
                parts.append(f"rank(s) {', '.join(map(str, missing))} never reported")
            who = "; ".join(parts)
        else:
            who = f"this rank ({self.rank}) was at step {self.progress.step + 1}, {self.progress.phase}"
        return (
            f"hang: no rank finished a step for {self.timeout_s:g} s (distributed.hang_timeout_s); "
            f"{who}. Python stacks of every rank: {self.diagnostics}/rank-<N>.txt; last collectives: "
            f"flight-recorder-rank-<N> there (python -m torch.distributed.flight_recorder.fr_trace "
            f"{self.diagnostics} --prefix flight-recorder-rank-)"
        )

    def _progress_of_all(self) -> dict[int, dict]:
        if self._store is None:
            return {}
        seen = {}
        for r in range(self.world_size):
            try:
                if self._store.check([str(r)]):
                    seen[r] = json.loads(self._store.get(str(r)))
            except Exception:
                continue
        return seen


def dump_flight_recorder(path: Path, backend: str) -> bool:
    """Write torch's flight recorder (the last collectives, in the pickle format torch's fr_trace
    analyser reads) to `path`. nccl keeps its own recorder, read by _dump_nccl_trace (CUDA builds);
    gloo's is read by _dump_fr_trace (torch 2.7 and later). False where there is nothing to dump."""
    c10d = getattr(torch._C, "_distributed_c10d", None)
    names = ("_dump_nccl_trace", "_dump_fr_trace") if backend == "nccl" else ("_dump_fr_trace",)
    dump = next((getattr(c10d, name) for name in names if hasattr(c10d, name)), None)
    if dump is None:
        return False
    try:
        path.write_bytes(dump())
        return True
    except Exception:
        return False
