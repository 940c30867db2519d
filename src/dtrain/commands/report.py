"""`dtrain report RUN_DIR`: a run's metrics.jsonl as plots and a short summary, in RUN_DIR/report/.

loss.png         training loss, eval loss and eval accuracy per step
throughput.png   samples/s per logged step
step_time.png    where each step's time went: data, compute, communication, optimizer (stacked)
ranks.png        every rank's busy time per step (a straggler stands out)
summary.txt      final metrics, mean throughput, communication share, stragglers seen
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from dtrain.errors import DtrainError
from dtrain.observe.memory import FIELDS as memory_fields
from dtrain.observe.memory import describe
from dtrain.rundir import OUTPUTS, yours

PHASES = ("data", "compute", "comm", "optimizer")


def load_records(run_dir: Path) -> list[dict[str, Any]]:
    """The usable records of RUN_DIR/metrics.jsonl. A damaged line (cut short by an interruption,
    edited, of another program) or a field of the wrong kind is left out, never trusted."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        what = "is not a file" if path.exists() else "does not exist"
        raise DtrainError(f"{path} {what}; pass a run.dir that a dtrain run wrote to")
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        raise DtrainError(f"{path} cannot be read ({exc.strerror or exc})") from None
    records: list[dict[str, Any]] = []
    for line in text.splitlines():
        try:
            record = _usable(json.loads(line), records)
        except ValueError:
            continue
        if record is not None:
            records.append(record)
    if not any("loss" in r for r in records):
        diverged = '"loss": null' in text  # what dtrain writes for a loss that is not a number
        raise DtrainError(
            f"{path} holds no training steps with a finite loss"
            + (" (the run diverged at its first log step)" if diverged else " yet")
            + "; nothing to report"
        )
    return records


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _usable(record: Any, earlier: list[dict[str, Any]]) -> dict[str, Any] | None:
    """`record` with only what the report can trust, or None: a training record needs step, epoch,
    loss and samples_per_s, an evaluation step, epoch and eval_loss; every other field is optional
    and dropped when it is of the wrong kind."""
    if not isinstance(record, dict) or not all(
        isinstance(record.get(k), int) and not isinstance(record.get(k), bool) for k in ("step", "epoch")
    ):
        return None
    required: tuple[str, ...]
    optional: tuple[str, ...]
    if "loss" in record:
        required, optional = ("loss", "samples_per_s"), ("lr", "grad_norm", "mfu", "pp_bubble")
    elif "eval_loss" in record:
        required, optional = ("eval_loss",), ("eval_accuracy",)
    else:
        return None
    if not all(_number(record.get(k)) for k in required):
        return None
    kept = {k: record[k] for k in ("step", "epoch", *required)}
    kept.update({k: record[k] for k in optional if _number(record.get(k))})
    # comm_ms is absent where it is not measured (FSDP): the other phases are still plotted.
    timing = ("step_ms", *(f"{p}_ms" for p in PHASES if p != "comm"))
    busy = record.get("rank_busy_ms")
    ranks = next((len(r["rank_busy_ms"]) for r in earlier if "rank_busy_ms" in r), None)
    if (
        all(_number(record.get(k)) for k in timing)
        and isinstance(busy, list)
        and busy
        and all(_number(b) for b in busy)
        and ranks in (None, len(busy))
    ):
        kept.update({k: record[k] for k in timing}, rank_busy_ms=busy)
        if _number(record.get("comm_ms")):
            kept["comm_ms"] = record["comm_ms"]
    sizes = [record.get(name) for name in memory_fields]  # the first log step's, per rank
    ranks = len(kept.get("rank_busy_ms", sizes[0] if isinstance(sizes[0], list) else []))
    if all(
        isinstance(v, list) and v and len(v) == ranks and all(_number(b) and 0 <= b < 2**60 for b in v) for v in sizes
    ):
        kept.update(zip(memory_fields, sizes))
        if isinstance(record.get("layout"), str):  # how the processes split the job (pp 2 × dp 1 × tp 2)
            kept["layout"] = record["layout"][:200]
    stragglers = record.get("stragglers")
    if isinstance(stragglers, list) and all(
        isinstance(s, dict) and isinstance(s.get("rank"), int) and isinstance(s.get("host"), str) for s in stragglers
    ):
        kept["stragglers"] = stragglers
    return kept


def build_figures(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The report's matplotlib figures, by file stem (only those the records have data for)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    figures = {}

    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if any("eval_accuracy" in r for r in evals):
        acc = ax.twinx()
        points = [r for r in evals if "eval_accuracy" in r]
        acc.plot(
            [r["step"] for r in points],
            [r["eval_accuracy"] for r in points],
            "s--",
            color="tab:green",
            label="eval accuracy",
        )
        acc.set_ylabel("eval accuracy")
        acc.set_ylim(0, 1)
        acc.legend(loc="center right")
    ax.legend(loc="upper right")
    ax.set_title("loss and accuracy")
    figures["loss"] = fig

    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot([r["step"] for r in train], [r["samples_per_s"] for r in train])
    ax.set_xlabel("step")
    ax.set_ylabel("samples/s (all ranks)")
    ax.set_title("throughput")
    figures["throughput"] = fig

    timed = [r for r in train if "step_ms" in r]
    if timed:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        _stack_phases(ax, timed)
        ax.plot([r["step"] for r in timed], [r["step_ms"] for r in timed], "k--", label="step (wall)")
        ax.set_xlabel("step")
        ax.set_ylabel("ms per step")
        ax.legend(loc="upper right")
        ax.set_title("where each step's time went (mean over ranks)")
        figures["step_time"] = fig

        fig, ax = plt.subplots(figsize=(8, 4.5))
        for rank in range(len(timed[-1]["rank_busy_ms"])):
            ax.plot([r["step"] for r in timed], [r["rank_busy_ms"][rank] for r in timed], label=f"rank {rank}")
        ax.set_xlabel("step")
        ax.set_ylabel("busy ms per step (waiting excluded)")
        ax.legend(loc="upper right")
        ax.set_title("per-rank step time")
        figures["ranks"] = fig
    measured = [r for r in train if "param_bytes" in r]
    if measured:
        last = measured[-1]
        ranks = range(len(last["param_bytes"]))
        fig, ax = plt.subplots(figsize=(8, 4.5))
        bottom = [0.0] * len(ranks)
        for name, label in (
            ("param_bytes", "parameters"),
            ("grad_bytes", "gradients"),
            ("optimizer_bytes", "optimizer state"),
        ):
            mib = [b / 2**20 for b in last[name]]
            ax.bar([r - 0.2 for r in ranks], mib, 0.4, bottom=bottom, label=label)
            bottom = [a + b for a, b in zip(bottom, mib)]
        ax.bar([r + 0.2 for r in ranks], [b / 2**20 for b in last["peak_bytes"]], 0.4, label="peak", color="grey")
        ax.set_xticks(list(ranks), [f"rank {r}" for r in ranks])
        ax.set_ylabel("MiB")
        ax.legend(loc="upper right")
        ax.set_title(f"what each rank holds (step {last['step']})")
        figures["memory"] = fig
    return figures


def _stack_phases(ax: Any, timed: list[dict[str, Any]]) -> None:
    """The phases stacked, one stack per stretch of windows that measured the same phases. A run resumed
    under another strategy into the same run.dir has windows with communication measured (DDP) and
    windows where it ran inside compute (FSDP): each shows what it measured, and communication is
    neither dropped from the DDP windows nor drawn as zero in the others. A stretch after the first
    starts at the step where the one before ended: its first window covers the steps in between."""
    colours = {p: f"C{i}" for i, p in enumerate(PHASES)}
    labelled: set[str] = set()
    start: int | None = None
    for phases, group in itertools.groupby(timed, key=lambda r: tuple(p for p in PHASES if f"{p}_ms" in r)):
        stretch = list(group)
        steps = [r["step"] for r in stretch]
        values = [[r[f"{p}_ms"] for r in stretch] for p in phases]
        if start is not None:
            steps, values = [start, *steps], [[v[0], *v] for v in values]
        labels = [p if p != "compute" or "comm" in phases else "compute (comm inside)" for p in phases]
        bands = ax.stackplot(
            steps,
            *values,
            colors=[colours[p] for p in phases],
            hatch=[None if label != "compute (comm inside)" else "//" for label in labels],
            labels=[label if label not in labelled else "_nolegend_" for label in labels],
        )
        for band, phase in zip(bands, phases):
            band.set_gid(phase)  # which phase a band is, for whoever reads the figure
        labelled.update(labels)
        start = stretch[-1]["step"]


def summary(records: list[dict[str, Any]]) -> str:
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    steady = train[1:] or train  # the first window holds warm-up
    lines = [
        f"steps: {train[-1]['step']} (epoch {train[-1]['epoch']})",
        f"final training loss: {train[-1]['loss']:.4f}",
    ]
    if evals:
        last = evals[-1]
        lines.append(
            f"final eval loss: {last['eval_loss']:.4f}"
            + (f", eval accuracy: {last['eval_accuracy']:.2%}" if "eval_accuracy" in last else "")
        )
    lines.append(
        f"mean throughput: {statistics.mean(r['samples_per_s'] for r in steady):,.0f} samples/s "
        f"(first logged window left out: warm-up)"
    )
    timed = [r for r in steady if "step_ms" in r]
    if timed:
        step = statistics.mean(r["step_ms"] for r in timed)
        # Each phase over the windows that measured it: a run resumed under another strategy has windows
        # with communication measured (DDP) and without (FSDP).
        shares = {}
        for p in PHASES:
            having = [r for r in timed if f"{p}_ms" in r]
            if having:
                phase_ms = statistics.mean(r[f"{p}_ms"] for r in having)
                shares[p] = phase_ms / statistics.mean(r["step_ms"] for r in having)
        lines.append(f"mean step: {step:.2f} ms — " + ", ".join(f"{p} {s:.0%}" for p, s in shares.items()))
        measured = sum("comm_ms" in r for r in timed)
        lines.append(
            "communication share: not measured (a sharded strategy's collectives run inside forward and "
            "backward, counted as compute)"
            if not measured
            else f"communication share: {shares['comm']:.0%} of step time"
            + (
                ""
                if measured == len(timed)
                else f" (in the {measured} of {len(timed)} logged windows that measured it; the others ran "
                f"under a sharded strategy)"
            )
        )
    bubbles = [r["pp_bubble"] for r in train if "pp_bubble" in r]
    if bubbles:  # the schedule's idle share: (p − 1) / (m + p − 1), fewer micro-batches a larger one
        lines.append(f"pipeline bubble: {statistics.mean(bubbles):.0%} of each step (the schedule's idle share)")
    if any("mfu" in r for r in steady):
        lines.append(f"mean MFU: {statistics.mean(r['mfu'] for r in steady if 'mfu' in r):.1%}")
    with_memory = [r for r in train if "param_bytes" in r]
    if with_memory:
        lines.append(describe(with_memory[-1]))
    seen = Counter((s["rank"], s["host"]) for r in train for s in r.get("stragglers", ()))
    if seen:
        lines.append(
            "stragglers seen: "
            + ", ".join(f"rank {rank} on {host} in {n} logged window(s)" for (rank, host), n in sorted(seen.items()))
        )
    else:
        lines.append("stragglers seen: none")
    return "\n".join(lines) + "\n"


def write_report(run_dir: Path) -> Path:
    """Write RUN_DIR/report/ and return it."""
    import matplotlib.pyplot as plt

    records = load_records(run_dir)
    out = Path(run_dir) / "report"
    problem = OUTPUTS["report"](out) if out.exists() or out.is_symlink() else None
    if problem:
        raise DtrainError(
            f"{out} is where dtrain writes its report, and it {problem} ({yours(out)}); move it "
            f"and run dtrain report again"
        )
    out.mkdir(parents=True, exist_ok=True)
    for name, fig in build_figures(records).items():
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=100)
        plt.close(fig)
    (out / "summary.txt").write_text(summary(records))
    return out
