"""Experiment trackers beyond TensorBoard and metrics.jsonl: MLflow and Weights & Biases, on rank 0 only.

    monitor.trackers = ["tensorboard", "mlflow", "wandb"]

MLflow logs to a local store under run.dir/mlruns unless MLFLOW_TRACKING_URI names a server (experiment
MLFLOW_EXPERIMENT_NAME, default "dtrain"); W&B writes under run.dir/wandb and honours WANDB_MODE=offline
(project WANDB_PROJECT, default "dtrain"). Both get the resolved config as parameters and every numeric
metric of every record at its step. Each is an optional extra, named in one line when it is missing.

A run ends its tracker runs as it ended (`ending`). A resumed run continues its earlier tracker runs, unless
the interrupted run logged past the checkpoint it resumes from: neither tracker can take those points back,
so the resumed run logs into new tracker runs tagged with the step it resumed from.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from dtrain.errors import EXIT_INTERRUPTED, ConfigError, DtrainError, Preempted

KNOWN = {"tensorboard": "tensorboard", "mlflow": "mlflow-skinny", "wandb": "wandb"}  # name → what to install


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules
        return False


def check_installed(names: list[str]) -> None:
    """Refuse, before anything starts, a tracker that is not installed here."""
    for name in names:
        if not _installed(name):
            raise ConfigError(
                f"monitor.trackers names {name}, which is not installed here; pip install "
                f"{KNOWN[name]} (or pip install 'dtrain[trackers]'), or drop it from monitor.trackers"
            )


def flat(config: dict[str, Any]) -> dict[str, Any]:
    """{"optimizer": {"lr": 0.1}} → {"optimizer.lr": 0.1}: how MLflow takes parameters."""
    return {f"{section}.{key}": value for section, values in config.items() for key, value in values.items()}


def numbers(record: dict[str, Any]) -> dict[str, float]:
    """The record's numeric metrics (not its step, epoch or clock)."""
    return {
        k: float(v)
        for k, v in record.items()
        if k not in ("step", "epoch", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def ending(error: BaseException | None) -> tuple[str, int]:
    """How a run ended, as MLflow's run status and the exit code W&B records — the worker's own exit
    status (worker/__init__.py): 0 finished; 75 stopped by SIGTERM with its checkpoint (preempted) and 130
    by Ctrl-C, both KILLED; 2 refused or diverged, 73 run.dir taken over by another run (RunDirLost) and 1
    crashed, all FAILED."""
    if error is None:
        return "FINISHED", 0
    if isinstance(error, (Preempted, KeyboardInterrupt)):
        return "KILLED", error.exit_code if isinstance(error, Preempted) else EXIT_INTERRUPTED
    return "FAILED", error.exit_code if isinstance(error, DtrainError) else 1


def restart_line(names: list[str], step: int) -> str:
    """The console line for tracker runs started anew on resume (see the module's docstring)."""
    which = " and ".join({"mlflow": "MLflow", "wandb": "W&B"}[n] for n in names)
    return (
        f"the interrupted run logged past step {step} and {which} cannot take those points back: this run "
        f"logs from step {step + 1} into new {which} runs tagged resumed_from_step={step}"
    )


class MLflowTracker:
    """A resumed run continues the MLflow run it started (found by its run.dir tag), or starts a new one
    tagged dtrain.resumed_from_step (`resumed_from`: the interrupted run logged past the checkpoint),
    ending the earlier one FAILED if the process that ran it was killed before it could."""

    def __init__(self, run_dir: Path, config: dict[str, Any], resuming: bool = False, resumed_from: int | None = None):
        import mlflow

        uri = os.environ.get("MLFLOW_TRACKING_URI", "")
        if urlsplit(uri).scheme in ("", "file"):
            # The local file store needs this opt-in since MLflow 3.7 (also where MLFLOW_TRACKING_URI names
            # one: a folder or a file: URI); the database store needs the full mlflow package. A server
            # needs neither.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        if not uri:
            mlflow.set_tracking_uri((run_dir / "mlruns").absolute().as_uri())
        experiment = mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "dtrain"))
        self._mlflow = mlflow
        where = str(run_dir.absolute())
        earlier = (
            mlflow.search_runs(
                [experiment.experiment_id],
                filter_string=f"tags.`dtrain.run_dir` = '{where}'",
                order_by=["attributes.start_time DESC"],
                max_results=1,
                output_format="list",
            )
            if resuming
            else []
        )
        if earlier and resumed_from is None:
            self._run = mlflow.start_run(run_id=earlier[0].info.run_id)
        else:
            if earlier and earlier[0].info.status == "RUNNING":
                # Its process ended without ending it (SIGKILL, the OOM killer, a lost node) and run.dir's
                # lock rules out a live one: nothing else ever will.
                mlflow.MlflowClient().set_terminated(earlier[0].info.run_id, status="FAILED")
            tags = {"dtrain.run_dir": where}
            if resumed_from is not None:
                tags["dtrain.resumed_from_step"] = str(resumed_from)
            self._run = mlflow.start_run(run_name=run_dir.absolute().name, tags=tags)
            mlflow.log_params({k: str(v)[:500] for k, v in flat(config).items()})

    def log(self, record: dict[str, Any]) -> None:
        self._mlflow.log_metrics(numbers(record), step=record["step"])

    def close(self, status: str = "FINISHED", exit_code: int = 0) -> None:
        self._mlflow.end_run(status=status)  # FINISHED, FAILED or KILLED


class WandbTracker:
    """A resumed run continues the W&B run it started (its id read from run.dir/wandb/latest-run), or
    starts a new one tagged resumed_from_step=N (`resumed_from`: the interrupted run logged past the
    checkpoint, and W&B drops what a run logs at a step it has passed)."""

    def __init__(self, run_dir: Path, config: dict[str, Any], resuming: bool = False, resumed_from: int | None = None):
        import wandb

        latest = run_dir / "wandb" / "latest-run"
        continuing = resuming and resumed_from is None and latest.is_symlink()
        earlier = os.readlink(latest).rsplit("-", 1)[-1] if continuing else None
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "dtrain"),
            dir=str(run_dir),
            config=config,
            name=run_dir.absolute().name,
            id=earlier,
            resume="allow" if earlier else None,
            tags=None if resumed_from is None else [f"resumed_from_step={resumed_from}"],
        )

    def log(self, record: dict[str, Any]) -> None:
        self._run.log(numbers(record), step=record["step"])

    def close(self, status: str = "FINISHED", exit_code: int = 0) -> None:
        self._run.finish(exit_code=exit_code)  # W&B marks a non-zero exit failed


def open_trackers(
    names: list[str],
    run_dir: Path,
    config: dict[str, Any],
    resuming: bool = False,
    resumed_from: int | None = None,
) -> list[Any]:
    """The trackers besides TensorBoard (which the monitor writes itself), started; `resuming`: the run
    continues from a checkpoint, and each tracker continues its own earlier run — or starts a new one,
    when the interrupted run logged past that checkpoint (`resumed_from`, the checkpoint's step)."""
    check_installed(names)
    kinds = {"mlflow": MLflowTracker, "wandb": WandbTracker}
    return [kinds[name](run_dir, config, resuming, resumed_from) for name in names if name in kinds]
