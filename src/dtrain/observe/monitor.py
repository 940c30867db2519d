"""What a run reports: rank 0's console (a progress bar on a terminal, plain lines otherwise),
`metrics.jsonl`, TensorBoard event files and the other trackers monitor.trackers names (trackers.py).
Every rank holds a Monitor; only rank 0's writes.

The trainer hands over numbers already reduced across ranks and already on the host — the monitor
never touches the device, so it cannot add a sync to the training step.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from dtrain.observe.memory import FIELDS as memory_fields
from dtrain.observe.stall import LossStall
from dtrain.observe.trackers import ending, open_trackers

# TensorBoard tags for the keys of a metrics record.
TB_TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "skipped_steps": "train/skipped_steps",  # fp16: steps GradScaler skipped in the window
    "samples_per_s": "train/samples_per_s",
    "tokens_per_s": "train/tokens_per_s",  # token data
    "eval_loss": "eval/loss",
    "train_loss": "eval/train_loss",  # the mean training loss since the last evaluation, beside eval/loss
    "eval_accuracy": "eval/accuracy",
    "eval_perplexity": "eval/perplexity",
    "step_ms": "time/step_ms",
    "data_ms": "time/data_ms",
    "compute_ms": "time/compute_ms",
    "comm_ms": "time/comm_ms",
    "optimizer_ms": "time/optimizer_ms",
    "pp_bubble": "time/pp_bubble",  # the pipeline schedule's idle share of a step
    "mfu": "perf/mfu",
    "checkpoint_blocked_s": "checkpoint/blocked_s",  # how long training waited for the checkpoint
    "checkpoint_write_s": "checkpoint/write_s",  # from its write's start to its seal
}


class Monitor:
    def __init__(
        self,
        run_dir: Path,
        enabled: bool,
        total_steps: int,
        initial_step: int = 0,
        progress_bar: bool | None = None,
        purge_after: int | None = None,
        trackers: Sequence[str] = ("tensorboard",),
        config: dict[str, Any] | None = None,
        logged_past: bool = False,
    ):
        """`purge_after`: the step of the checkpoint a resumed run continues; `logged_past`: the interrupted
        run had logged beyond it (the trackers then start new runs: see trackers.py)."""
        self.enabled = enabled
        self._stragglers: tuple = ()
        self._stall, self._last_step = LossStall(), initial_step  # a loss that never changes: said once
        self._bar = None
        self._writer = None
        self._metrics: IO[str] | None = None
        self._trackers: list[Any] = []
        if not enabled:
            return
        if "tensorboard" in trackers:
            from torch.utils.tensorboard import SummaryWriter  # imported late: it pulls in tensorboard

            # On resume, TensorBoard drops what the interrupted run logged after the checkpoint.
            self._writer = SummaryWriter(
                log_dir=str(run_dir / "tensorboard"), purge_step=None if purge_after is None else purge_after + 1
            )
        others = [t for t in trackers if t != "tensorboard"]
        resumed_from = purge_after if logged_past else None
        self._trackers = open_trackers(others, run_dir, config or {}, purge_after is not None, resumed_from)
        self._metrics = (run_dir / "metrics.jsonl").open("a" if initial_step else "w")
        if progress_bar is None:
            progress_bar = sys.stderr.isatty()
        if progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=initial_step, unit="step", dynamic_ncols=True, file=sys.stderr)

    def advance(self) -> None:
        """One optimizer step done (cheap: tqdm redraws at most every 0.1 s)."""
        if self._bar is not None:
            self._bar.update(1)

    def log(self, record: dict[str, Any]) -> None:
        """Write one metrics record (train or eval) everywhere it belongs."""
        if not self.enabled or self._metrics is None:  # not rank 0, or closed
            return
        # metrics.jsonl first, so that it holds whatever a tracker holds: a resume reads from it whether
        # the trackers hold steps past its checkpoint (trackers.py).
        self._metrics.write(json.dumps(_strict_json(record)) + "\n")
        self._metrics.flush()
        if self._writer is not None:
            self._tensorboard(record)
        for tracker in self._trackers:
            tracker.log(record)
        line = format_record(record)
        if self._bar is not None and "loss" in record:
            self._bar.set_postfix_str(line.split(" | ", 2)[-1], refresh=False)  # the bar shows progress
        else:
            self.info(line)
        if "loss" in record:
            stalled = self._stall.check(record, self._last_step)
            self._last_step = record["step"]
            if stalled:
                self.info(stalled)
        slow = tuple((s["rank"], s["host"]) for s in record.get("stragglers", ()))
        if slow != self._stragglers and "loss" in record:
            self._stragglers = slow
            for s in record.get("stragglers", ()):
                self.info(
                    f"straggler: rank {s['rank']} on {s['host']} is {s['slower']:.0%} slower than the "
                    f"median rank (busy {record['rank_busy_ms'][s['rank']]:.1f} ms per step, "
                    f"waiting excluded)"
                )

    def _tensorboard(self, record: dict[str, Any]) -> None:
        writer, step = self._writer, record["step"]
        if writer is None:
            return
        for key, tag in TB_TAGS.items():
            if record.get(key) is not None:
                writer.add_scalar(tag, record[key], step)
        for key, value in record.items():  # the user's eval_metrics
            if key.startswith("eval_") and key not in TB_TAGS and key != "eval_samples" and isinstance(value, float):
                writer.add_scalar(f"eval/{key[len('eval_') :]}", value, step)
        for name in memory_fields:  # once, at the first log step
            for rank, size in enumerate(record.get(name, [])):
                writer.add_scalar(f"memory/{name}/rank{rank}", size, step)
        if isinstance(record.get("layout"), str):  # how the processes split the job: with the memory it holds
            writer.add_text("run/layout", record["layout"], step)
        for rank, ms in enumerate(record.get("rank_busy_ms", [])):
            writer.add_scalar(f"ranks/busy_ms/rank{rank}", ms, step)

    def info(self, message: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr, flush=True)

    def close(self, error: BaseException | None = None) -> None:
        """`error`: what ended the run, if anything did; the trackers mark their run failed (or killed, on
        a stop the job was asked for) rather than finished, with the run's exit status (trackers.ending)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        status, exit_code = ending(error)
        for tracker in self._trackers:
            tracker.close(status, exit_code)
        self._trackers = []


# How each metric reads on the console, in this order.
CONSOLE_FORMATS = [
    ("loss", "loss {:.4f}"),
    ("lr", "lr {:.3g}"),
    ("grad_norm", "grad_norm {:.3g}"),
    ("samples_per_s", "{:,.0f} samples/s"),
    ("tokens_per_s", "{:,.0f} tokens/s"),
    ("step_ms", "step {:.1f} ms"),
    ("pp_bubble", "pipeline bubble {:.0%}"),
    ("mfu", "MFU {:.1%}"),
    ("eval_loss", "eval_loss {:.4f}"),
    ("eval_accuracy", "eval_accuracy {:.2%}"),
    ("eval_perplexity", "eval_perplexity {:.4g}"),
    ("train_loss", "train_loss {:.4f}"),  # last: an eval line still begins with eval_loss
]


def format_record(record: dict[str, Any]) -> str:
    if "checkpoint" in record:  # one line per sealed checkpoint (Checkpointer.report)
        blocked, write = record["checkpoint_blocked_s"], record["checkpoint_write_s"]
        how = (
            f"in the background in {write:.2f} s; training blocked {blocked:.3f} s"
            if record.get("checkpoint_background")
            else f"in {write:.2f} s; training blocked {blocked:.2f} s"
        )
        return f"checkpoint {record['checkpoint']} written {how}"
    parts = [f"step {record['step']}", f"epoch {record['epoch']}"]
    for key, fmt in CONSOLE_FORMATS:
        if record.get(key) is not None:
            parts.append(fmt.format(record[key]))
            if key == "step_ms":  # where the step went
                parts[-1] += " = " + " + ".join(
                    f"{name} {record[f'{name}_ms']:.1f}" if f"{name}_ms" in record else f"{name} not measured"
                    for name in ("data", "compute", "comm", "optimizer")
                )
    known = {key for key, _ in CONSOLE_FORMATS} | {"eval_samples"}
    for key, value in record.items():  # the user's eval_metrics (training.eval_metrics, Trainer's), as logged
        if key.startswith("eval_") and key not in known and isinstance(value, (int, float)):
            parts.append(f"{key} {value:.4g}")
    return " | ".join(parts)


def _strict_json(value: Any) -> Any:
    """`value` with nan and inf as null: metrics.jsonl stays JSON every parser reads (a diverged loss)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strict_json(v) for v in value]
    return value
