"""The quick start's command, run again as a new user does: with its config untouched, a finished run says
it is complete (exit 0, no worker started), more epochs train on from its end with each step logged once,
and `--resume` where there is nothing to resume says which case it is. One finished quick-start run (the
`quick_start` fixture, shared with the README's test) serves the cases that only read it; those that
change it train on a copy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from helpers import QUICK_START, SMALL_JOB, ok, run

COMPLETE = (
    "dtrain: run.dir runs/digits_mlp is already complete (step 240 of 240, epoch 20 of 20); nothing to train — raise "
    "training.epochs or training.max_steps to train on"
)


def files(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def logged(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def tensorboard_steps(run_dir: Path, tag: str) -> list[int]:
    """The steps of `tag` over every event file of the run, in the order they were written."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = []
    for events in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        steps += [event.step for event in accumulator.Scalars(tag)] if tag in accumulator.Tags()["scalars"] else []
    return steps


def copy_of(quick_start: Path, tmp_path: Path) -> Path:
    shutil.copytree(quick_start, tmp_path / "quick")
    return tmp_path / "quick"


def test_the_quick_start_again_says_it_is_complete_and_starts_no_worker(quick_start):
    """The same command, with --resume, on one process (it trained its epochs on two), and with a file of
    the user's dropped beside it (.DS_Store): one line, exit 0, and nothing in run.dir written (a worker
    would have written config.toml and said where it resumed from)."""
    before = files(quick_start / "runs")
    for again in ([], ["--resume"], ["--nproc", "1"]):
        result = ok(run([*QUICK_START, *again], cwd=quick_start))
        assert result.stderr.splitlines() == [COMPLETE], (again, result.stderr)
    dropped = quick_start / "runs" / "digits_mlp" / ".DS_Store"
    dropped.write_bytes(b"\0")
    assert ok(run(QUICK_START, cwd=quick_start)).stderr.splitlines() == [COMPLETE]
    dropped.unlink()
    assert files(quick_start / "runs") == before


def test_a_finished_run_rerun_with_other_settings_is_complete_and_writes_nothing(quick_start, tmp_path):
    """Other settings that only the training would use (a learning rate, a batch size): the workers start,
    resume, find nothing to train and say so — and leave run.dir as it was (its config.toml still the one
    that trained it, no new event file, the weights not rewritten), so the same command stays the quick one."""
    folder = copy_of(quick_start, tmp_path)
    before = files(folder / "runs")
    other = ok(run([*QUICK_START, "optimizer.lr=0.05", "data.batch_size=32"], cwd=folder))
    assert (
        "resumed from runs/digits_mlp/checkpoints/step-240 (step 240 of 240, epoch 20 of 20): the run is already "
        "complete" in other.stderr
    )
    after = {path: data for path, data in files(folder / "runs").items() if path.name != ".lock"}
    assert after == {path: data for path, data in before.items() if path.name != ".lock"}
    assert ok(run(QUICK_START, cwd=folder)).stderr.splitlines() == [COMPLETE]


def test_the_quick_start_with_more_epochs_trains_on_from_its_end_each_step_logged_once(quick_start, tmp_path):
    """training.epochs 20 → 22: on from step 240 with the schedule rebuilt, 24 steps more; metrics.jsonl and
    TensorBoard hold each step once (the end's evaluation at 240 is not run and logged again)."""
    folder = copy_of(quick_start, tmp_path)
    result = ok(run([*QUICK_START, "training.epochs=22"], cwd=folder))
    assert "resumed from runs/digits_mlp/checkpoints/step-240 (step 240 of 264, epoch 20 of 22)" in result.stderr
    assert (
        "the config changed since that checkpoint (steps 240 → 264): this run follows it from step 240, the "
        "learning-rate schedule rebuilt for its plan" in result.stderr
    )
    run_dir = folder / "runs" / "digits_mlp"
    records = logged(run_dir)
    train = [r["step"] for r in records if "loss" in r]
    evals = [r["step"] for r in records if "eval_loss" in r]
    assert train == [*range(10, 241, 10), 250, 260, 264] and evals == [*range(12, 265, 12)], (train, evals)
    assert tensorboard_steps(run_dir, "train/loss") == train
    assert tensorboard_steps(run_dir, "eval/loss") == evals


def test_a_finished_run_trained_on_continues_its_tracker_run(warm, tmp_path, monkeypatch):
    """MLflow's run of a finished job continues when it trains on: one run, each step once."""
    job = [*SMALL_JOB, "--nproc", "2", f"run.dir={tmp_path}", 'monitor.trackers=["mlflow"]']
    ok(warm("run", *job))
    ok(warm("run", *job, "training.epochs=3"))
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # reading the local store, as dtrain wrote it
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    [tracked] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    steps = [m.step for m in client.get_metric_history(tracked.info.run_id, "eval_loss")]
    assert steps == [8, 16, 24], steps


def test_without_an_end_checkpoint_the_rerun_is_complete_and_training_on_is_refused(quick_start, tmp_path):
    """checkpoint.at_end=false: the final weights alone. The same command (and --resume) still says the run
    is complete; more epochs are refused in one line naming what would work; nothing is written."""
    folder = tmp_path / "noend"
    shutil.copytree(quick_start / "examples", folder / "examples")
    no_end = [*QUICK_START, "checkpoint.at_end=false"]
    ok(run(no_end, cwd=folder))
    run_dir = folder / "runs" / "digits_mlp"
    assert not (run_dir / "checkpoints").exists()
    before = files(run_dir)
    for again in ([], ["--resume"]):
        result = ok(run([*no_end, *again], cwd=folder))
        assert result.stderr.splitlines() == [
            "dtrain: run.dir runs/digits_mlp is already complete (step 240 of 240, epoch 20 of 20); nothing to train, "
            "and it kept no checkpoint to train on from (checkpoint.at_end = false): to train on, start a new "
            "run.dir from its weights (model.init_from=runs/digits_mlp run.dir=<a new folder>)"
        ], result.stderr
    more = run([*no_end, "training.epochs=22"], cwd=folder)
    assert more.returncode == 2 and more.stderr.splitlines() == [
        "dtrain: error: run.dir runs/digits_mlp holds a run that finished at step 240 and kept no checkpoint to "
        "train on from (checkpoint.at_end = false); start a new run.dir from its weights "
        "(model.init_from=runs/digits_mlp run.dir=<a new folder>), or set run.overwrite=true to replace it"
    ], more.stderr
    insisted = run([*no_end, "training.epochs=22", "--resume"], cwd=folder)
    assert insisted.returncode == 2 and insisted.stderr.splitlines() == [
        "dtrain: error: --resume: run.dir runs/digits_mlp finished at step 240 and kept no checkpoint to train on "
        "from (checkpoint.at_end = false): to train on, start a new run.dir from its weights "
        "(model.init_from=runs/digits_mlp run.dir=<a new folder>), or set run.overwrite=true to start again"
    ], insisted.stderr
    assert files(run_dir) == before
    # What the line offers works: a new run.dir from those weights.
    ok(run([*QUICK_START, "model.init_from=runs/digits_mlp", "run.dir=runs/on", "training.epochs=2"], cwd=folder))


def test_resume_with_nothing_to_resume_says_which_case_it_is(quick_start, tmp_path):
    """--resume where nothing ever ran, and where a run was killed before its first checkpoint (what it left:
    metrics and events, no checkpoint, no weights): each one line, exit 2, nothing created."""
    never = run([*QUICK_START, "--resume", f"run.dir={tmp_path / 'never'}"], cwd=quick_start)
    assert never.returncode == 2 and never.stderr.splitlines() == [
        f"dtrain: error: --resume: run.dir {tmp_path / 'never'} holds no run yet; start it without --resume"
    ]
    assert not (tmp_path / "never").exists()
    killed = tmp_path / "killed"
    killed.mkdir()
    for left in ("metrics.jsonl", "tensorboard"):
        copy = shutil.copytree if left == "tensorboard" else shutil.copy
        copy(quick_start / "runs" / "digits_mlp" / left, killed / left)
    stopped = run([*QUICK_START, "--resume", f"run.dir={killed}"], cwd=quick_start)
    assert stopped.returncode == 2 and stopped.stderr.splitlines() == [
        f"dtrain: error: --resume: {killed}/checkpoints holds no complete checkpoint to continue from (the run "
        f"stopped before its first); start afresh with run.overwrite=true instead of --resume"
    ]
