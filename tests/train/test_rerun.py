"""A rerun says what it will do: the lines of a run stopped, resumed and rerun once finished, exactly as
the console prints them — `dtrain run --nproc 2` on the warm workers (tests/pool.py: the launcher's part
and the workers' under torchrun, gloo), real checkpoints."""

import re

import pytest

from helpers import SMALL_JOB, dtrain, eval_lines, ok, train_lines, weights

# SMALL_JOB: 300 samples, 240 to train on, 120 a process; batches of 16: 8 steps an epoch, 16 in all.
JOB = [*SMALL_JOB, "--nproc", "2", "checkpoint.every_steps=8"]
DONE = "nothing to train — raise training.epochs or training.max_steps to train on"


def lines_of(result):
    return [line for line in result.stderr.splitlines() if line.strip()]


def step_lines(result):
    """(step, epoch, train or eval) of each metrics line on the console."""
    found = [re.match(r"step (\d+) \| epoch (\d+) \| (loss|eval_loss) ", line) for line in lines_of(result)]
    return [(int(m[1]), int(m[2]), m[3]) for m in found if m]


@pytest.fixture(scope="module")
def finished(pool, tmp_path_factory):
    """A 2-epoch run stopped in its 2nd epoch (step 12), then resumed to its end: both runs' output."""
    run_dir = tmp_path_factory.mktemp("finished")
    stopped = ok(pool.run("run", *JOB, f"run.dir={run_dir}", "training.stop_at_step=12"))
    resumed = ok(pool.run("run", *JOB, f"run.dir={run_dir}"))
    return run_dir, stopped, resumed


def test_train_eval_and_resume_lines_count_epochs_alike(finished):
    """The epoch of a step is counted from 1 on every line: the 2nd epoch's steps say epoch 2 on the train
    lines, on its evaluation and on the resume line (they said 1, 2 and 1)."""
    run_dir, stopped, resumed = finished
    assert step_lines(stopped) == [(5, 1, "loss"), (8, 1, "eval_loss"), (10, 2, "loss")]
    assert f"resumed from {run_dir}/checkpoints/step-12 (step 12 of 16, epoch 2 of 2)" in lines_of(resumed)
    assert step_lines(resumed) == [(15, 2, "loss"), (16, 2, "loss"), (16, 2, "eval_loss")]
    assert [(m["step"], m["epoch"]) for m in train_lines(run_dir)] == [(5, 1), (10, 2), (15, 2), (16, 2)]
    assert [(m["step"], m["epoch"]) for m in eval_lines(run_dir)] == [(8, 1), (16, 2)]


def test_a_finished_run_rerun_says_it_is_complete_whatever_only_training_would_use(pool, finished):
    """The same command, --resume, or a data.batch_size whose global batch no accumulation makes up (the
    checkpoint's is 32): one line, exit 0, no worker started. Asking for more steps with that batch size
    is still refused, in the one line saying which batch sizes can continue."""
    run_dir = finished[0]
    complete = f"dtrain: run.dir {run_dir} is already complete (step 16 of 16, epoch 2 of 2); {DONE}"
    for rerun in ([], ["--resume"], ["data.batch_size=7"], ["data.batch_size=7", "--resume"]):
        assert lines_of(ok(pool.run("run", *JOB, f"run.dir={run_dir}", *rerun))) == [complete], rerun
    more = pool.run("run", *JOB, f"run.dir={run_dir}", "data.batch_size=7", "training.epochs=3")
    assert more.returncode == 2 and lines_of(more) == [
        "dtrain: error: checkpoint step-16 trained on global batches of 32 samples (2 processes × 16); 2 processes "
        "with data.batch_size=7 cannot make that up in whole accumulation steps: set data.batch_size to a divisor "
        "of 16, such as 2, 4, 8, 16"
    ]
    assert [m["step"] for m in train_lines(run_dir)] == [5, 10, 15, 16]  # nothing trained, nothing logged


def test_a_finished_run_without_its_weights_resumes_to_write_them_and_says_so(pool, finished, tmp_path):
    """The launcher's shortcut needs the weights there: without them the workers resume, write them, and
    the resume line says the run is complete."""
    run_dir = finished[0]
    kept = weights(run_dir)
    (run_dir / "model.safetensors").unlink()
    again = ok(pool.run("run", *JOB, f"run.dir={run_dir}"))
    assert lines_of(again)[-1] == (
        f"resumed from {run_dir}/checkpoints/step-16 (step 16 of 16, epoch 2 of 2): the run is already complete; {DONE}"
    )
    assert weights(run_dir).keys() == kept.keys()


def test_a_runs_config_toml_says_a_rerun_command_that_works(solo, tmp_path):
    """The first line of config.toml says how to rerun the run; followed as written it trains the same job
    (run.dir's own config.toml is never the config being read, so the rerun goes to a new folder)."""
    ok(solo.run("run", *SMALL_JOB, "training.epochs=1", f"run.dir={tmp_path / 'first'}"))
    header = (tmp_path / "first" / "config.toml").read_text().splitlines()[0]
    command = re.fullmatch(r"# The resolved config of this run, written by dtrain\. Rerun it with: dtrain (.*)", header)
    assert command, header
    args = command[1].replace("<this file>", str(tmp_path / "first" / "config.toml"))
    ok(dtrain(*args.replace("<a new folder>", str(tmp_path / "again")).split()))
    assert [m["loss"] for m in train_lines(tmp_path / "again")] == [m["loss"] for m in train_lines(tmp_path / "first")]
