"""Ctrl-C is a clean stop: as a terminal sends it (SIGINT to the whole foreground process group), under
`dtrain run`, `dtrain launch` and plain torchrun, the workers finish their step, write a checkpoint, and one
dtrain line says where; the job exits 130 and the same command resumes bitwise. A second Ctrl-C ends the
workers at once, saying what a rerun will do."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtrain.checkpoint import CheckpointStore
from helpers import ROOT, SMALL_JOB, TIMEOUT, WORKERS, env, ok, weights

# 240 training samples, 120 a process, batches of 16: 8 steps an epoch; every step logged (a stop agreed
# at each), each step slowed so that the signal lands mid-run.
JOB = [*SMALL_JOB, "training.epochs=4", "training.log_every=1", "model.name=faults:dying_mlp"]


def job(run_dir: Path, step_sleep_s: float = 0.05, *extra: str) -> list[str]:
    return [*JOB, f"model.options={{hidden_size = 16, step_sleep_s = {step_sleep_s}}}", f"run.dir={run_dir}", *extra]


def command(how: str, run_dir: Path, step_sleep_s: float = 0.05, *extra: str) -> list[str]:
    """The job started `how`: `dtrain run --nproc 2`, `dtrain launch --nproc 2` of a user's script that
    trains it (config_trainer.py), or plain torchrun of that script."""
    args = job(run_dir, step_sleep_s, *extra)
    script = str(WORKERS / "config_trainer.py")
    if how == "run":
        return [sys.executable, "-m", "dtrain", "run", *args, "--nproc", "2"]
    if how == "launch":
        return [sys.executable, "-m", "dtrain", "launch", "--nproc", "2", script, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script, *args]


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return sum('"loss"' in line for line in path.read_text().splitlines()) if path.exists() else 0


def ctrl_c(argv: list[str], run_dir: Path, *, after_steps: int = 3, again_after_s: float | None = None):
    """Run `argv` as a terminal's foreground job (a process group of its own, SIGINT live), press Ctrl-C
    once `after_steps` steps are logged (and again `again_after_s` later); its exit status and stderr."""
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)  # a child inherits an ignored SIGINT
    try:
        job = subprocess.Popen(
            argv, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
    finally:
        signal.signal(signal.SIGINT, inherited)
    deadline = time.monotonic() + TIMEOUT
    while logged_steps(run_dir) < after_steps:
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.02)
    os.killpg(job.pid, signal.SIGINT)
    if again_after_s is not None:
        time.sleep(again_after_s)
        os.killpg(job.pid, signal.SIGINT)
    _, err = job.communicate(timeout=TIMEOUT)
    return job.returncode, err


def dtrain_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("dtrain:")]


@pytest.fixture(scope="module")
def uninterrupted(warm, tmp_path_factory) -> dict:
    """The job's final weights when nothing stops it."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    ok(warm("run", *job(run_dir), "--nproc", "2"))
    return weights(run_dir)


@pytest.mark.parametrize("how", ["run", "launch"])
def test_ctrl_c_checkpoints_says_one_line_exits_130_and_the_same_command_resumes_bitwise(tmp_path, how, uninterrupted):
    code, err = ctrl_c(command(how, tmp_path), tmp_path)
    assert code == 130, err
    [checkpoint] = CheckpointStore(tmp_path).complete()
    assert dtrain_lines(err) == [
        f"dtrain: interrupted (Ctrl-C) at step {checkpoint.step}; checkpoint written to {tmp_path}/checkpoints/"
        f"step-{checkpoint.step}; rerun the same command to resume"
    ], err
    # Nothing of torch's: no traceback, no agent warning ("Received 2 death signal").
    assert "Traceback" not in err and "death signal" not in err and not re.search(r"^[WE]\d{4} ", err, re.M), err
    assert 0 < checkpoint.step < 32
    resumed = ok(subprocess.run(command(how, tmp_path), cwd=ROOT, env=env(), capture_output=True, text=True))
    assert f"resumed from {checkpoint.path} (step {checkpoint.step} of 32" in resumed.stderr
    final = weights(tmp_path)
    assert all(final[name].equal(uninterrupted[name]) for name in uninterrupted), "not bitwise the uninterrupted run"


def test_ctrl_c_under_plain_torchrun_checkpoints_and_the_workers_say_one_line(tmp_path):
    """torchrun's own agent passes the SIGINT on: the workers stop as under dtrain's launcher (torchrun then
    prints its own warning and traceback, which dtrain cannot change), rank 0 saying the one line."""
    _, err = ctrl_c(command("torchrun", tmp_path), tmp_path)
    [checkpoint] = CheckpointStore(tmp_path).complete()
    assert dtrain_lines(err) == [
        f"dtrain: interrupted (Ctrl-C) at step {checkpoint.step}; checkpoint written to {tmp_path}/checkpoints/"
        f"step-{checkpoint.step}; rerun the same command to resume"
    ], err
    assert "Interrupted" not in err and "dtrain/train" not in err, err  # no worker's traceback


def test_a_second_ctrl_c_stops_at_once_and_says_what_a_rerun_will_do(warm, tmp_path):
    """Steps of 0.5 s, a checkpoint every 2: the first Ctrl-C asks for a stop at the end of the step, the
    second (0.15 s later, within that step) ends the workers there. The one line names the newest sealed
    checkpoint, which the rerun resumes from; the stop's own checkpoint was never written."""
    argv = command("run", tmp_path, 0.5, "checkpoint.every_steps=2")
    code, err = ctrl_c(argv, tmp_path, after_steps=3, again_after_s=0.15)
    assert code == 130, err
    newest = CheckpointStore(tmp_path).newest()
    assert newest is not None and newest.step == 2, err
    [line] = dtrain_lines(err)
    assert re.fullmatch(
        r"dtrain: interrupted again at step (\d+): stopped at once, without a checkpoint of it; the same command "
        r"resumes from step-2",
        line,
    ), err
    assert "Traceback" not in err, err
    rerun = ok(warm("run", *job(tmp_path), "--nproc", "2", "training.max_steps=4"))
    assert f"resumed from {newest.path}" in rerun.stderr


FAULTS = str(Path(__file__).resolve().parent.parent / "workers" / "process_faults")


@pytest.mark.parametrize("how", ["run", "launch"])
def test_ctrl_c_while_the_workers_import_torch_says_one_line_and_no_traceback(tmp_path, how):
    """Ctrl-C to the launcher as rank 0 starts importing torch (sent by the worker itself, see
    sitecustomize.py): torch's agent passes it on mid-import. One dtrain line, 130 — not a KeyboardInterrupt
    traceback per rank from inside torch's import (as `dtrain launch`'s script workers gave)."""
    faults = {
        "SIGTERM_AT_IMPORT": "torch@rank0",
        "SIGTERM_AT_IMPORT_TO": "parent",
        "SIGTERM_AT_IMPORT_SIGNAL": "SIGINT",
        "PYTHONPATH": os.pathsep.join([FAULTS, env()["PYTHONPATH"]]),
    }
    result = subprocess.run(
        command(how, tmp_path), cwd=ROOT, env=env(**faults), capture_output=True, text=True, timeout=TIMEOUT
    )
    assert result.returncode == 130, result.stderr
    assert dtrain_lines(result.stderr) == [
        "dtrain: interrupted (Ctrl-C) before training began; nothing to save — rerun the same command to start"
    ], result.stderr
    assert "Traceback" not in result.stderr and "KeyboardInterrupt" not in result.stderr, result.stderr


# A dtrain worker (early_stop's handlers installed, as `dtrain run`'s are) whose Trainer let go of the signals:
# `ENDING` ends the `with StopRequest()` as a finished run (nothing) or a stop (Interrupted), then the
# process gets Ctrl-C while it would still be tearing down.
AFTER_THE_RUN = """
import os, signal, sys, time
from dtrain import early_stop
early_stop.install(interrupt=True)
from dtrain.errors import Interrupted
from dtrain.train.stopping import StopRequest
try:
    with StopRequest():
        if sys.argv[1] == "stopped":
            raise Interrupted("interrupted (Ctrl-C) at step 3; ...")
except Interrupted:
    pass
os.kill(os.getpid(), signal.SIGINT)
time.sleep(30)
"""


@pytest.mark.parametrize("ending", ["finished", "stopped"])
def test_ctrl_c_as_a_worker_ends_after_its_run_exits_at_once_without_a_traceback(ending):
    """After a finished run, Ctrl-C during the worker's teardown says in one line that the run had finished
    (130); after a stop that said its line, it ends the process quietly. Before, the default handler raised
    KeyboardInterrupt inside torch's and dtrain's exit handlers: tracebacks, or a doubled line."""
    result = subprocess.run(
        [sys.executable, "-c", AFTER_THE_RUN, ending], env=env(), capture_output=True, text=True, timeout=TIMEOUT
    )
    assert result.returncode == 130, result.stderr
    expected = (
        [
            "dtrain: interrupted (Ctrl-C) as the run ended: it had finished, nothing is lost — the same command says "
            "it is complete"
        ]
        if ending == "finished"
        else []
    )
    assert result.stderr.splitlines() == expected, result.stderr
