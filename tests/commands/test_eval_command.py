"""`dtrain eval RUN_DIR [--step N]`: a checkpoint's eval metrics without training, through the real CLI and
launcher where it evaluates on 2 processes (elsewhere on the warm workers, tests/pool.py). One small run
(checkpoints and evaluations every 5 steps) serves most checks; the numbers `dtrain eval` gives are
compared with those the run itself logged to metrics.jsonl."""

import json
import os
from pathlib import Path

import pytest

from helpers import SMALL_JOB, dtrain, eval_lines, ok

EVERY_5 = ["checkpoint.every_steps=5", "checkpoint.keep=3", "training.eval_every_steps=5"]
F1 = "training.eval_metrics=config_metrics:macro_f1"  # a whole-split metric named in the config


@pytest.fixture(scope="module")
def trained(solo, tmp_path_factory):
    """A 30-step run on one process: checkpoints step-20, -25, -30 kept; eval lines every 5 steps."""
    run_dir = tmp_path_factory.mktemp("eval-cmd") / "run"
    console = ok(solo.run("run", *SMALL_JOB, *EVERY_5, F1, f"run.dir={run_dir}")).stderr
    (run_dir.parent / "console.txt").write_text(console)  # beside run.dir: the run's own lines
    return run_dir, {line["step"]: line for line in eval_lines(run_dir)}


def evaluated(start, run_dir, out: Path, *args: str, **kwargs) -> dict:
    """`dtrain eval RUN_DIR ARGS --out OUT` started by `start` (helpers.dtrain: the real command and
    launcher; `warm`: on the warm workers): the metrics it wrote (and the line it said)."""
    result = ok(start("eval", str(run_dir), *args, "--out", str(out), **kwargs))
    record = json.loads(out.read_text())
    assert result.stdout.startswith(f"{run_dir} checkpoint step-{record['step']} | eval_loss ")
    return record


def logged_metrics(line: dict) -> dict:
    return {k: v for k, v in line.items() if k.startswith("eval_")}


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()
    }


def test_eval_of_the_newest_and_of_a_chosen_step_give_exactly_what_the_run_logged(warm, trained, tmp_path):
    run_dir, logged = trained
    newest = evaluated(warm, run_dir, tmp_path / "newest.json")
    assert newest["step"] == 30 and newest["world_size"] == 1
    assert 0 < logged[30]["eval_f1"] < 1  # training.eval_metrics: the run's records and dtrain eval carry it
    console = (run_dir.parent / "console.txt").read_text()  # and the run's console eval line shows it
    assert f"eval_f1 {logged[30]['eval_f1']:.4g}" in next(
        x for x in console.splitlines() if x.startswith("step 30 |") and "eval_loss" in x
    )
    assert {k: newest[k] for k in logged_metrics(logged[30])} == logged_metrics(logged[30])
    at_20 = evaluated(warm, run_dir, tmp_path / "20.json", "--step", "20")
    assert at_20["step"] == 20
    assert {k: at_20[k] for k in logged_metrics(logged[20])} == logged_metrics(logged[20])
    assert at_20["eval_loss"] != newest["eval_loss"]  # the step's own weights, not the newest


def test_eval_on_two_processes_equals_eval_on_one_and_writes_nothing_into_the_run_dir(warm, trained, tmp_path):
    run_dir, logged = trained
    before = snapshot(run_dir)
    one = evaluated(warm, run_dir, tmp_path / "one.json", "--step", "25")
    two = evaluated(dtrain, run_dir, tmp_path / "two.json", "--step", "25", "--nproc", "2")
    assert two["world_size"] == 2 and two["eval_samples"] == one["eval_samples"] == logged[25]["eval_samples"]
    assert two["eval_accuracy"] == one["eval_accuracy"] and two["eval_f1"] == one["eval_f1"] == logged[25]["eval_f1"]
    # Float32 batch means over other batches (each rank's share): equal to float32's precision, not bit for bit.
    assert abs(two["eval_loss"] - one["eval_loss"]) < 1e-6
    # No lease taken, nothing written: checkpoints, metrics, config, every byte and time as they were.
    assert snapshot(run_dir) == before


def test_a_run_still_training_is_evaluated_with_an_override_of_its_config(warm, trained, tmp_path):
    from dtrain.rundir.lock import RunDirLock

    run_dir, _ = trained
    training = RunDirLock(run_dir)  # held as a live run holds it: eval neither waits for it nor takes it
    training.acquire()
    try:
        capped = evaluated(warm, run_dir, tmp_path / "capped.json", "training.eval_batches=1", "data.eval_batch_size=8")
        assert training.held()
    finally:
        training.release(remove_if_created=True)
    assert capped["eval_samples"] == 8  # training.eval_batches × data.eval_batch_size, as the run would cap it


def test_a_missing_step_or_a_folder_that_is_no_run_dir_is_one_line(cli, trained, tmp_path):
    run_dir, _ = trained
    for args, said in (
        ([str(run_dir), "--step", "7"], f"{run_dir} holds no complete checkpoint step-7; complete steps: 20, 25, 30"),
        ([str(tmp_path)], f"{tmp_path} holds no config.toml"),
        ([str(run_dir), "--out", str(run_dir / "eval.json")], f"--out {run_dir / 'eval.json'} is inside the run.dir"),
        (
            [str(run_dir), "training.eval_metrics=config_metrics:no_such"],
            "training.eval_metrics = 'config_metrics:no_such': module 'config_metrics' has no function 'no_such'",
        ),
        (
            [str(run_dir), "--out", str(tmp_path / "no_such" / "eval.json")],
            f"--out {tmp_path / 'no_such' / 'eval.json'}: folder {tmp_path / 'no_such'} does not exist",
        ),
        ([str(run_dir), "training.eval_metrics=:"], "training.eval_metrics = ':': write it as 'package.module:name'"),
    ):
        result = cli("eval", *args)
        lines = (result.stdout + result.stderr).splitlines()
        assert result.returncode == 2 and len(lines) == 1, (result.returncode, lines)
        assert lines[0].startswith(f"dtrain: error: {said}"), lines[0]


def test_a_damaged_checkpoint_is_named_in_one_line(cli, trained, tmp_path):
    """A truncated checkpoint file: the line a resume says, not the tensor reader's traceback."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(trained[0], run_dir)
    shard = sorted((run_dir / "checkpoints" / "step-30" / "state").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    result = cli("eval", str(run_dir))
    lines = (result.stdout + result.stderr).splitlines()
    assert result.returncode == 2 and len(lines) == 1, (result.returncode, lines)
    assert lines[0].startswith(f"dtrain: error: checkpoint step-30 is damaged: {shard} is truncated"), lines[0]


def test_a_run_trained_under_fsdp_evaluates_at_its_world_size_exactly_and_at_one_process(warm, pool, tmp_path):
    run_dir = tmp_path / "fsdp"
    fsdp = ["parallel.strategy=fsdp", "training.epochs=1", "data.num_samples=200", "--nproc", "2"]
    ok(pool.run("run", *SMALL_JOB, *EVERY_5, *fsdp, f"run.dir={run_dir}"))
    logged = {line["step"]: line for line in eval_lines(run_dir)}
    two = evaluated(dtrain, run_dir, tmp_path / "two.json", "--step", "5", "--nproc", "2")
    assert {k: two[k] for k in logged_metrics(logged[5])} == logged_metrics(logged[5])  # its world size: exact
    one = evaluated(warm, run_dir, tmp_path / "one.json", "--step", "5")  # the sharded checkpoint, resharded to one
    assert one["eval_samples"] == logged[5]["eval_samples"] and one["eval_accuracy"] == logged[5]["eval_accuracy"]
    assert abs(one["eval_loss"] - logged[5]["eval_loss"]) < 1e-6


def test_a_run_of_a_script_is_refused_in_one_line(cli, tmp_path):
    """A run whose model was given in code to dtrain.Trainer: config.toml cannot rebuild it."""
    run_dir = tmp_path / "script"
    script = tmp_path / "train.py"
    script.write_text(
        "import sys, torch, dtrain\n"
        "from torch.utils.data import TensorDataset\n"
        "data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))\n"
        "config = dtrain.Config()\n"
        "config.run.dir = sys.argv[1]\n"
        "config.training.epochs = 1\n"
        "dtrain.Trainer(config, model=torch.nn.Linear(4, 2), train_data=data, eval_data=data).fit()\n"
    )
    ok(dtrain("launch", str(script), str(run_dir)))
    result = cli("eval", str(run_dir))
    lines = (result.stdout + result.stderr).splitlines()
    assert result.returncode == 2 and len(lines) == 1, (result.returncode, lines)
    assert "dtrain eval evaluates runs of `dtrain run CONFIG` only" in lines[0]


def test_a_run_dir_url_is_evaluated_read_only(warm, trained, s3, tmp_path):
    run_dir, logged = trained
    s3.filesystem().put(str(run_dir) + "/", f"{s3.bucket}/runs/eval", recursive=True)
    url, machine = s3.url("runs/eval"), {**s3.env, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    before = sorted(s3.filesystem().find(f"{s3.bucket}/runs/eval"))
    at_25 = evaluated(warm, url, tmp_path / "25.json", "--step", "25", extra_env=machine)
    assert {k: at_25[k] for k in logged_metrics(logged[25])} == logged_metrics(logged[25])
    assert sorted(s3.filesystem().find(f"{s3.bucket}/runs/eval")) == before  # no lease, nothing written
    assert not os.listdir(tmp_path / "cache" / "dtrain" / "run-reads")  # the local copy removed after
