"""A rerun says what it will do: the lines of a finished run rerun, as the console prints them — real
`dtrain run --nproc 2` (torchrun, gloo), real checkpoints."""

import re

import pytest

from helpers import SMALL_JOB, dtrain, eval_lines, ok, train_lines

# SMALL_JOB: 300 samples, 240 to train on, 120 a process; batches of 16: 8 steps an epoch, 16 in all.
JOB = [*SMALL_JOB, "--nproc", "2", "checkpoint.every_steps=8"]


def lines_of(result):
    return [line for line in result.stderr.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("finished")
    return run_dir, ok(dtrain("run", *JOB, f"run.dir={run_dir}"))


def test_train_eval_and_resume_lines_count_epochs_alike(finished):
    """The epoch of a step is counted from 1 on every line: the 2nd epoch's steps say epoch 2 on the train
    lines, its evaluation and the resume line of a rerun (they once said 1, 2 and 1)."""
    run_dir, first = finished
    said = [re.match(r"step (\d+) \| epoch (\d+) \| (loss|eval_loss) ", line) for line in lines_of(first)]
    assert [m.groups() for m in said if m] == [
        ("5", "1", "loss"),
        ("8", "1", "eval_loss"),
        ("10", "2", "loss"),
        ("15", "2", "loss"),
        ("16", "2", "loss"),
        ("16", "2", "eval_loss"),
    ]
    assert [(m["step"], m["epoch"]) for m in train_lines(run_dir)] == [(5, 1), (10, 2), (15, 2), (16, 2)]
    assert [(m["step"], m["epoch"]) for m in eval_lines(run_dir)] == [(8, 1), (16, 2)]
    again = ok(dtrain("run", *JOB, f"run.dir={run_dir}"))
    assert lines_of(again) == [
        f"resumed from {run_dir}/checkpoints/step-16 (step 16 of 16, epoch 2 of 2): the run is already complete; "
        f"nothing to train — raise training.epochs or training.max_steps to train on"
    ]
