"""Checkpoints, exact resume, crashes, preemption, and what must be refused — with real processes."""

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dtrain.checkpoint import CheckpointStore
from dtrain.checkpoint.store import MARKER
from helpers import ROOT, TIMEOUT, WORKERS, dtrain, env, mount_tmpfs, ok, train_lines, unmount, weights

JOB = [
    "examples/digits_mlp.toml",
    "data.name=synthetic",
    "data.num_samples=500",
    "data.input_shape=[12]",
    "data.num_classes=3",
    "data.batch_size=16",
    "model.name=faults:dying_mlp",
    "training.epochs=3",
    "training.log_every=1",
    "scheduler.name=cosine",
]
MODEL = "model.options={hidden_size = 32%s}"  # 400 samples, 200 a rank: 13 steps an epoch, 39 in all


def run_job(run_dir, *extra, nproc=2, model_extra="", on=None):
    """The job as `dtrain run` runs it; `on` the warm workers (the pool or solo fixture) where the test reads
    what the run wrote rather than proves the launcher."""
    start = on.run if on is not None else dtrain
    return start("run", *JOB, MODEL % model_extra, "--nproc", str(nproc), f"run.dir={run_dir}", *extra)


def launcher_refuses(cli, run_dir, *extra, nproc=2):
    """`run_job` for a run the launcher refuses before any worker starts: answered in this process."""
    return cli("run", *JOB, MODEL % "", "--nproc", str(nproc), f"run.dir={run_dir}", *extra)


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), f"{key} differs"


@pytest.fixture(scope="module")
def reference(pool, tmp_path_factory):
    """The job run start to finish without interruption."""
    run_dir = tmp_path_factory.mktemp("reference")
    ok(run_job(run_dir, on=pool))
    return run_dir


@pytest.fixture(scope="module")
def checkpointed(pool, tmp_path_factory):
    """The same job with a checkpoint every 10 steps and the default checkpoint.keep (3): step-10 is
    written, then pruned; step-20, -30, -39 are kept."""
    run_dir = tmp_path_factory.mktemp("checkpointed")
    ok(run_job(run_dir, "checkpoint.every_steps=10", on=pool))
    return run_dir


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# --- exact resume -------------------------------------------------------------------------------


def test_stop_and_resume_is_bitwise_equal_in_every_situation(warm_torchrun, tmp_path):
    """Mid-epoch, at an epoch boundary, part-way through accumulation, in bf16, with AdamW."""
    ok(warm_torchrun(WORKERS / "resume_scenarios.py", tmp_path))
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results) == {"mid_epoch", "epoch_boundary", "accumulation", "bf16", "adamw"}
    stops = {"mid_epoch": 7, "epoch_boundary": 10, "accumulation": 5, "bf16": 13, "adamw": 6}
    for name, result in results.items():
        assert result["stopped_at"] == result["resumed_at"] == stops[name], name
        whole, first, second = result["forwards"]
        assert first > 0 and second > 0 and first + second == whole, f"{name}: {result['forwards']}"
        assert result["equal"], f"{name}: resumed run ended with different weights"
        # checkpoint.every_steps=0: the stop's checkpoint, and the end's (the run had one), nothing else;
        # rerunning the finished run trains nothing and leaves the same weights.
        assert sorted(result["checkpoints"]) == sorted([f"step-{stops[name]}", f"step-{result['total_steps']}"]), name
        assert result["rerun"] == [result["total_steps"], 0], name


def test_a_finished_run_extended_by_a_rerun_really_trains_on(solo, tmp_path):
    """Rerun with training.epochs raised: the new config governs — the cosine schedule is rebuilt for
    the longer run (the restored one ended at learning rate 0) and the loss keeps falling."""
    ok(run_job(tmp_path, "training.epochs=1", "checkpoint.every_steps=5", nproc=1, on=solo))
    first = train_lines(tmp_path)
    assert first[-1]["step"] == 25 and first[-1]["lr"] < 0.01  # cosine: the end of the schedule
    extended = ok(
        run_job(tmp_path, "training.epochs=3", "checkpoint.every_steps=5", "optimizer.momentum=0.5", nproc=1, on=solo)
    )
    assert re.search(
        r"^the config changed since that checkpoint \(steps 25 → 75, optimizer.momentum 0.9 → 0.5\): "
        r"this run follows it from step 25, the learning-rate schedule rebuilt for its plan$",
        extended.stderr,
        re.M,
    ), extended.stderr
    saved = json.loads((tmp_path / "checkpoints" / "step-75" / "trainer.json").read_text())
    assert {group["momentum"] for group in saved["optimizer"]["param_groups"]} == {0.5}  # not the restored 0.9
    later = [m for m in train_lines(tmp_path) if m["step"] > 25]
    assert [m["step"] for m in later] == list(range(26, 76))
    assert later[0]["lr"] > 0.1  # cosine at 25 of 75 steps, not the old schedule's 0
    assert sum(m["loss"] for m in later[-10:]) < sum(m["loss"] for m in first[-10:])
    # What cannot be honoured is refused: a plan shorter than the run already is.
    refused(
        run_job(tmp_path, "training.epochs=1", nproc=1, on=solo),
        "is at step 75 and this config plans 25 steps (training.epochs=1, training.max_steps=0); raise "
        "them to continue that run, or start a new run.dir",
    )
    # ... and so is what the checkpoint's state or position means nothing under.
    for change, fragment in (
        (
            "optimizer.name=adamw",
            "optimizer.name = 'sgd' there and 'adamw' here: its optimizer state does not carry over",
        ),
        ("run.seed=7", "run.seed = 0 there and 7 here: the data order of the epoch in progress"),
        ("data.num_samples=600", "training samples = 400 there and 480 here"),
    ):
        refused(run_job(tmp_path, "training.epochs=4", change, nproc=1, on=solo), fragment)
    assert [m["step"] for m in train_lines(tmp_path)][-1] == 75  # nothing trained, nothing lost


def test_checkpoints_are_kept_k_and_sealed(checkpointed, reference):
    store = CheckpointStore(checkpointed)
    assert [c.step for c in store.complete()] == [20, 30, 39]  # keep = 3: the oldest went
    assert sorted(p.name for p in store.root.iterdir()) == ["step-20", "step-30", "step-39"]
    meta = json.loads((checkpointed / "checkpoints" / "step-39" / MARKER).read_text())
    assert meta["world_size"] == 2 and meta["step"] == 39
    assert {"trainer.json", "rng-rank0.safetensors", "rng-rank1.safetensors", "state/.metadata"} <= set(meta["files"])
    assert_same_weights(reference, checkpointed)  # checkpointing changes nothing


def test_resume_from_another_runs_checkpoint_reads_it_where_it_is(pool, checkpointed, reference, tmp_path):
    """--resume-from a step-N folder of another run: a new run.dir goes on from it and ends bitwise where the
    uninterrupted run ended; the other run's checkpoints stay as they were. A rerun then continues the new
    run.dir's own checkpoint, newer than the one given."""
    given = checkpointed / "checkpoints" / "step-20"
    before = {p: p.stat().st_mtime_ns for p in checkpointed.rglob("*")}
    branch = tmp_path / "branch"
    resumed = ok(run_job(branch, "--resume-from", str(given), "checkpoint.every_steps=10", on=pool))
    assert re.search(rf"^resumed from {re.escape(str(given))} \(step 20 of 39, epoch 2 of 3\)$", resumed.stderr, re.M)
    assert_same_weights(reference, branch)
    assert [c.step for c in CheckpointStore(branch).complete()] == [30, 39]
    assert {p: p.stat().st_mtime_ns for p in checkpointed.rglob("*")} == before  # read, never written
    assert [m["step"] for m in train_lines(branch)] == list(range(21, 40))
    rerun = ok(run_job(branch, "--resume-from", str(given), "checkpoint.every_steps=10", on=pool))
    assert "is already complete (step 39 of 39" in rerun.stderr  # its own step-39 wins: nothing to train


def test_resume_from_what_is_not_a_usable_checkpoint_is_one_line(pool, checkpointed, tmp_path):
    refused(run_job(tmp_path / "a", "--resume-from", str(tmp_path / "nowhere"), on=pool), "nowhere does not exist")
    refused(
        run_job(tmp_path / "a", "--resume-from", str(checkpointed / "metrics.jsonl"), on=pool), "is not a checkpoint"
    )
    damaged = copy_run(checkpointed, tmp_path / "damaged")
    target = damaged / "checkpoints" / "step-30" / "state" / "__0_0.distcp"
    target.write_bytes(target.read_bytes()[:-10])
    refused(
        run_job(tmp_path / "b", "--resume-from", str(damaged / "checkpoints" / "step-30"), on=pool),
        f"--resume-from {damaged / 'checkpoints' / 'step-30'}: checkpoint step-30 is damaged",
        "give another checkpoint",
    )
    assert (damaged / "checkpoints" / "step-30").is_dir()  # never deleted, nor advised to be
    own = copy_run(checkpointed, tmp_path / "own")
    refused(
        run_job(own, "--resume-from", str(own / "checkpoints" / "step-20"), on=pool),
        "is a checkpoint of this run.dir older than its newest, step-39",
    )
    # run.overwrite would delete the checkpoint given (and every other) before any worker read it.
    refused(
        run_job(own, "--resume-from", str(own / "checkpoints" / "step-20"), "run.overwrite=true", on=pool),
        f"--resume-from {own / 'checkpoints' / 'step-20'} lies in run.dir {own}, which run.overwrite=true replaces",
    )
    assert [c.step for c in CheckpointStore(own).complete()] == [20, 30, 39]  # nothing deleted


# --- failures -----------------------------------------------------------------------------------


def test_a_killed_worker_is_restarted_and_the_run_ends_the_same(reference, tmp_path):
    # Rank 1 dies by SIGKILL in its 23rd training forward pass (step 23); checkpoints every 5 steps.
    result = ok(
        run_job(
            tmp_path,
            "--max-restarts",
            "1",
            "checkpoint.every_steps=5",
            model_extra=", die_at_forward = 23, die_rank = 1",
        )
    )
    # The restarted group's own line (a first attempt never prints one): it continued from step 20.
    assert re.search(r"^resumed from \S+/checkpoints/step-20 \(step 20 of 39, epoch 2 of 3\)$", result.stderr, re.M), (
        result.stderr
    )
    assert_same_weights(reference, tmp_path)


def wait_for(predicate, timeout=TIMEOUT, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


SLOW = ", step_sleep_s = 0.1"  # about 4 s for the 39 steps: long enough to be caught mid-run


def start_slow_job(run_dir, *extra, nproc=2, slow=SLOW):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dtrain",
            "run",
            *JOB,
            MODEL % slow,
            "--nproc",
            str(nproc),
            f"run.dir={run_dir}",
            *extra,
        ],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_sigterm_writes_one_checkpoint_and_asks_to_be_requeued(pool, reference, tmp_path):
    proc = start_slow_job(tmp_path)
    wait_for(lambda: logged_steps(tmp_path) >= 5, what="training to start")
    proc.send_signal(signal.SIGTERM)  # to the launcher, as SLURM or Kubernetes would
    _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 75, err
    complete = CheckpointStore(tmp_path).complete()
    assert len(complete) == 1 and 5 <= complete[0].step < 39
    assert f"stopped by SIGTERM at step {complete[0].step}" in err
    assert not (tmp_path / "model.safetensors").exists()
    resumed = ok(run_job(tmp_path, on=pool))  # the same command (without the slow-down)
    assert f"resumed from {complete[0].path}" in resumed.stderr
    assert_same_weights(reference, tmp_path)
    # metrics.jsonl reads as one run: every step once.
    assert [m["step"] for m in train_lines(tmp_path)] == list(range(1, 40))


FSDP = "parallel.strategy=fsdp"


@pytest.fixture(scope="module")
def reference_fsdp(pool, tmp_path_factory):
    """The job run start to finish under FSDP."""
    run_dir = tmp_path_factory.mktemp("reference_fsdp")
    ok(run_job(run_dir, FSDP, on=pool))
    return run_dir


def test_under_fsdp_sigterm_and_kill_9_leave_a_checkpoint_the_run_resumes_from(pool, reference_fsdp, tmp_path):
    """As under DDP: SIGTERM writes one (sharded) checkpoint and asks to be requeued, the same command
    resumes; a worker killed by SIGKILL restarts the group from the newest checkpoint; both end with
    the weights of the run that was never interrupted."""
    stopped = tmp_path / "sigterm"
    proc = start_slow_job(stopped, FSDP)
    wait_for(lambda: logged_steps(stopped) >= 5, what="training to start")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 75, err
    complete = CheckpointStore(stopped).complete()
    assert len(complete) == 1 and 5 <= complete[0].step < 39
    assert sorted(p.name for p in (complete[0].path / "state").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]  # a shard each
    resumed = ok(run_job(stopped, FSDP, on=pool))
    assert f"resumed from {complete[0].path}" in resumed.stderr
    assert_same_weights(reference_fsdp, stopped)

    killed = tmp_path / "killed"
    result = ok(
        run_job(
            killed,
            FSDP,
            "--max-restarts",
            "1",
            "checkpoint.every_steps=5",
            model_extra=", die_at_forward = 23, die_rank = 1",
        )
    )
    assert re.search(r"^resumed from \S+/checkpoints/step-20 \(step 20 of 39, epoch 2 of 3\)$", result.stderr, re.M), (
        result.stderr
    )
    assert_same_weights(reference_fsdp, killed)


def test_kill_during_a_checkpoint_write_leaves_the_previous_one_loadable(warm, tmp_path):
    wide = [
        "examples/digits_mlp.toml",
        "data.name=synthetic",
        "data.num_samples=100",
        "data.input_shape=[1000]",
        "data.batch_size=8",
        "model.name=faults:wide_linear",
        "model.options={width = 30000}",
        "optimizer.momentum=0",
        "training.epochs=1",
        "checkpoint.every_steps=2",
        "checkpoint.keep=10",
        f"run.dir={tmp_path}",
        "--nproc",
        "1",
    ]  # a 120 MB model: each write takes a while
    proc = subprocess.Popen(
        [sys.executable, "-m", "dtrain", "run", *wide],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    root = tmp_path / "checkpoints"
    partial = lambda: [p for p in root.glob(".partial-*")] if root.exists() else []  # noqa: E731
    wait_for(
        lambda: ((root / "step-2" / MARKER).exists() and partial()) or proc.poll() is not None,
        what="a checkpoint write after the first one",
    )
    proc.kill()
    proc.wait(timeout=TIMEOUT)
    assert partial(), "the run finished before a write could be interrupted"
    interrupted = int(partial()[0].name.split("-")[-1])
    newest = CheckpointStore(tmp_path).newest()
    assert newest is not None and newest.step < interrupted
    resumed = ok(warm("run", *wide))
    assert f"resumed from {newest.path}" in resumed.stderr
    assert not partial()  # cleaned up
    assert CheckpointStore(tmp_path).newest().step == 10


# --- refusals -----------------------------------------------------------------------------------


def refused(result, *fragments):
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("dtrain: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize("damage", ["corrupt", "truncated"])
def test_a_damaged_checkpoint_is_named_and_the_previous_one_still_loads(
    cli, pool, checkpointed, reference, tmp_path, damage
):
    run_dir = copy_run(checkpointed, tmp_path / "run")
    target = run_dir / "checkpoints" / "step-39" / "state" / "__0_0.distcp"
    data = bytearray(target.read_bytes())
    if damage == "corrupt":
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    else:
        target.write_bytes(bytes(data[:-100]))
    result = launcher_refuses(cli, run_dir, "--resume")
    refused(
        result,
        f"checkpoint step-39 is damaged: {target} is {damage}",
        f"delete {run_dir / 'checkpoints' / 'step-39'} to resume from step-30",
    )
    if damage == "truncated":
        return
    # The fix the message gives works: step-30 loads, and the run ends bitwise where it should.
    shutil.rmtree(run_dir / "checkpoints" / "step-39")
    resumed = ok(run_job(run_dir, "--resume", on=pool))
    assert re.search(r"^resumed from \S+/checkpoints/step-30 \(step 30 of 39, epoch 3 of 3\)$", resumed.stderr, re.M)
    assert_same_weights(reference, run_dir)


def test_a_checkpoint_from_another_world_size_is_refused(cli, checkpointed, tmp_path):
    """A resume that would train on one process from a 2-process checkpoint (the finished run itself is
    complete on any number: every epoch it plans was trained)."""
    run_dir = copy_run(checkpointed, tmp_path / "run")
    shutil.rmtree(run_dir / "checkpoints" / "step-39")  # not finished: the resume would train
    refused(
        launcher_refuses(cli, run_dir, "--resume", nproc=1),
        "checkpoint step-30 was written by 2 processes and this run has 1",
        "resume with 2 processes",
    )


def test_a_global_batch_size_other_than_the_checkpoints_is_refused(cli, checkpointed, tmp_path):
    """The checkpoint trained on global batches of 32 (2 processes × 16): a resume stating another
    training.global_batch_size is refused in one line rather than silently keeping the checkpoint's."""
    run_dir = copy_run(checkpointed, tmp_path / "run")
    shutil.rmtree(run_dir / "checkpoints" / "step-39")  # not finished: the resume would train
    refused(
        launcher_refuses(cli, run_dir, "--resume", "training.global_batch_size=64"),
        "checkpoint step-30 trained on global batches of 32 samples and training.global_batch_size = 64",
        "give training.global_batch_size=32",
    )


def test_a_checkpoint_of_another_model_shape_is_refused(checkpointed, tmp_path):
    run_dir = copy_run(checkpointed, tmp_path / "run")
    refused(
        dtrain("run", *JOB, "model.options={hidden_size = 48}", "--nproc", "2", f"run.dir={run_dir}", "--resume"),
        "checkpoint step-39 holds 'net.1.weight' of shape [32, 12] and this run's model has [48, 12]",
    )


def test_resume_without_checkpoints_and_fresh_start_over_checkpoints_are_refused(cli, checkpointed, tmp_path):
    refused(launcher_refuses(cli, tmp_path / "empty", "--resume"), "holds no run yet; start it without --resume")
    assert not (tmp_path / "empty").exists()
    run_dir = copy_run(checkpointed, tmp_path / "run")
    refused(
        launcher_refuses(cli, run_dir, "checkpoint.resume=no"), "already holds checkpoints (newest step-39)", "--resume"
    )


def test_workers_die_with_a_launcher_killed_by_sigkill_and_a_rerun_resumes(pool, reference, tmp_path):
    slower = ", step_sleep_s = 0.3"  # about 12 s of training: the workers would outlive the check by far
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dtrain",
            "run",
            *JOB,
            MODEL % slower,
            "--nproc",
            "2",
            f"run.dir={tmp_path}",
            "checkpoint.every_steps=5",
        ],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # no pipe for workers to hold
    wait_for(lambda: (tmp_path / "checkpoints" / "step-5").exists(), what="the first checkpoint")
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2
    proc.kill()  # SIGKILL: the launcher can do nothing about it
    proc.wait(timeout=TIMEOUT)
    wait_for(lambda: not any(_alive(pid) for pid in workers), timeout=3, what="the workers to die with it")
    # Nothing holds run.dir: the same command continues from the newest checkpoint and ends as one run.
    resumed = ok(run_job(tmp_path, "checkpoint.every_steps=5", on=pool))
    step = int(re.search(r"^resumed from \S+/checkpoints/step-(\d+) \(step \d+ of 39", resumed.stderr, re.M)[1])
    assert 5 <= step < 39  # mid-run: the workers did not go on to finish it
    assert_same_weights(reference, tmp_path)


def _alive(pid: str) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _slow_steps_run(tmp_path, model_options: str, log_every: int) -> subprocess.Popen:
    """A 2-process run of slow steps (`model_options` for the sleepy model) with a 4 s preemption grace."""
    return subprocess.Popen(
        [sys.executable, "-m", "dtrain", "run", *JOB, MODEL % model_options, "--nproc", "2"]
        + [f"run.dir={tmp_path}", f"training.log_every={log_every}", "checkpoint.preempt_grace_s=4"],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_slow_steps_agree_on_sigterm_within_the_grace_between_log_steps(tmp_path):
    """Steps of 0.5 s, training.log_every = 26 and checkpoint.preempt_grace_s = 4: SIGTERM at step 13
    (the first epoch's evaluation), and waiting for the next log step (26, 6.5 s later) to agree on the stop
    would outlast the grace and lose the work. The ranks, having agreed on their pace at the second step,
    agree on a stop every 2 steps here (grace / 4 of steps), so the checkpoint is written in time."""
    proc = _slow_steps_run(tmp_path, ", step_sleep_s = 0.5", log_every=26)
    wait_for(lambda: logged_steps(tmp_path) >= 1, what="the first evaluation (step 13)")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 75, err
    complete = CheckpointStore(tmp_path).complete()
    assert len(complete) == 1 and 13 < complete[0].step <= 18, (complete, err)
    assert f"stopped by SIGTERM at step {complete[0].step}" in err


def test_steps_that_slow_down_later_are_agreed_on_within_the_grace(tmp_path):
    """Steps fast at first (the pace agreed at step 2 leaves log steps as the only agreement), 0.5 s
    each from step 3 on; training.log_every = 10 and checkpoint.preempt_grace_s = 4. The log step at 10
    re-agrees the pace from its window (a stop every 2 steps: grace / 4 of them), so SIGTERM after it is
    acted on within 2 steps, not at the next log step (20, up to 5 s later: past the grace)."""
    proc = _slow_steps_run(tmp_path, ", step_sleep_s = 0.5, slow_from_forward = 3", log_every=10)
    wait_for(lambda: logged_steps(tmp_path) >= 1, what="the log step at 10")
    at = logged_steps(tmp_path)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 75, err
    assert time.monotonic() - start < 4, err  # within the grace
    complete = CheckpointStore(tmp_path).complete()
    assert len(complete) == 1 and 10 < complete[0].step <= 13, (at, complete, err)
    assert f"stopped by SIGTERM at step {complete[0].step}" in err


def test_preempt_grace_s_bounds_the_wait_after_sigterm(tmp_path):
    """Steps of 5 s and checkpoint.preempt_grace_s = 1: torchrun does not wait for the step (and its
    checkpoint) to finish, it kills the workers when the grace ends."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dtrain",
            "run",
            *JOB,
            MODEL % ", step_sleep_s = 5.0",
            "--nproc",
            "2",
            f"run.dir={tmp_path}",
            "checkpoint.preempt_grace_s=1",
        ],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: logged_steps(tmp_path) >= 1, what="the first step")
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=TIMEOUT)
    assert time.monotonic() - start < 4.5, err  # the grace, not the 5 s step
    assert proc.returncode == 75, err
    assert CheckpointStore(tmp_path).complete() == []  # the step never finished: no checkpoint


def test_a_directory_in_the_way_of_the_final_weights_keeps_the_trained_state(pool, reference, tmp_path):
    """The end of a run is its most valuable moment: when model.safetensors cannot be written, the
    trained state goes into a checkpoint, the one line says where, and rerunning writes the weights."""
    proc = start_slow_job(tmp_path)  # no checkpoint.every_steps: nothing saved along the way
    wait_for(lambda: logged_steps(tmp_path) >= 3, what="training to start")
    (tmp_path / "model.safetensors").mkdir()  # appears after the launcher's checks
    _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 2, err
    assert err.strip().splitlines()[-1] == (
        f"dtrain: error: could not write {tmp_path / 'model.safetensors'} (Is a directory); the trained "
        f"state is safe in {tmp_path / 'checkpoints'}/step-39: make room (or move what is in the way) and rerun "
        f"the same command to write the weights"
    )
    assert err.count("dtrain: error:") == 1
    (tmp_path / "model.safetensors").rmdir()
    rerun = ok(run_job(tmp_path, model_extra=SLOW, on=pool))
    assert "(step 39 of 39, epoch 3 of 3): the run is already complete" in rerun.stderr
    assert_same_weights(reference, tmp_path)


@pytest.mark.parametrize("obstacle", ["weights_dir", "run_dir_file", "symlink_loop"])
def test_a_run_dir_that_cannot_work_is_refused_by_the_launcher(cli, tmp_path, obstacle):
    run_dir = tmp_path / "run"
    if obstacle == "weights_dir":
        (run_dir / "model.safetensors").mkdir(parents=True)
        message = f"{run_dir / 'model.safetensors'} is not a file (a folder?), and the run writes its final weights"
    elif obstacle == "run_dir_file":
        run_dir.write_text("not a folder")
        message = f"run.dir {run_dir} is a file, not a folder; choose another run.dir"
    else:
        run_dir.symlink_to(tmp_path / "loop")
        (tmp_path / "loop").symlink_to(run_dir)
        message = f"run.dir {run_dir} cannot be used"
    before = sorted(p.name for p in tmp_path.iterdir())
    refused(launcher_refuses(cli, run_dir), message)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_run_dir_in_use_by_a_live_run_is_refused(cli, tmp_path):
    # Slower steps than the others' (about 40 s in all, stopped by SIGTERM once checked): the second run
    # must reach the lock while the first still trains, however long its start takes on a busy machine.
    first = start_slow_job(tmp_path, slow=", step_sleep_s = 1.0")
    try:
        wait_for(lambda: logged_steps(tmp_path) >= 5, what="the first run to start")
        refused(launcher_refuses(cli, tmp_path), f"run.dir {tmp_path} is in use by another run (pid")
        assert first.poll() is None  # the first run is unharmed
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=TIMEOUT)
    assert first.returncode == 75


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs of the test's own."""
    mount = tmp_path / "small"
    if not mount_tmpfs(mount, "3m"):
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield mount
    unmount(mount)


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(warm, small_disk, tmp_path):
    # ~1.1 MB a checkpoint (weights + momentum): the first fits in 3 MB, the second does not.
    job = [
        "examples/digits_mlp.toml",
        "data.name=synthetic",
        "data.num_samples=200",
        "data.input_shape=[12]",
        "model.name=faults:wide_linear",
        "model.options={width = 9000}",
        "training.epochs=4",
        "checkpoint.every_steps=4",
        "checkpoint.keep=1",
        "--nproc",
        "2",
    ]
    run_dir = small_disk / "run"
    result = dtrain("run", *job, f"run.dir={run_dir}")
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert result.stderr.count("dtrain: error:") == 1 and last.startswith(
        "dtrain: error: could not write checkpoint step-8"
    )
    assert "No space left on device" in last and "step-4 is intact" in last
    store = CheckpointStore(run_dir)
    assert [c.step for c in store.complete()] == [4]
    assert not list(store.root.glob(".partial-*"))
    # The surviving checkpoint loads: resume it on a disk with room.
    moved = copy_run(run_dir, tmp_path / "roomy")
    resumed = ok(warm("run", *job, f"run.dir={moved}"))
    assert re.search(r"^resumed from \S+/checkpoints/step-4 \(step 4 of 8, epoch 2 of 4\)$", resumed.stderr, re.M), (
        resumed.stderr
    )


def test_a_disk_filling_up_before_the_final_save_keeps_the_trained_weights(warm, small_disk, tmp_path):
    """The disk was roomy at the start (the launcher checks), fills up during training: neither the final
    weights nor a checkpoint fit, so the weights go to the system's temporary folder, and one line says
    where. They are the very weights the run trained."""
    big = MODEL.replace("32", "20000")  # 1.4 MB of weights, 2.7 MB a checkpoint: neither fits in what is left
    reference = tmp_path / "reference"
    ok(warm("run", *JOB, big % "", "--nproc", "2", f"run.dir={reference}"))
    spare = tmp_path / "spare"  # "another disk": where the system's temporary folder is
    spare.mkdir()
    run_dir = small_disk / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dtrain", "run", *JOB, big % SLOW, "--nproc", "2", f"run.dir={run_dir}"],
        cwd=ROOT,
        env=env(TMPDIR=str(spare)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: logged_steps(run_dir) >= 3, what="training to start")
    free = shutil.disk_usage(small_disk).free
    (small_disk / "filler").write_bytes(b"\0" * (free - (200 << 10)))  # leave 200 KiB: enough for the logs
    _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 2, err
    rescued = list(spare.glob("dtrain-rescued-weights-*/model.safetensors"))
    assert len(rescued) == 1, err
    last = err.strip().splitlines()[-1]
    assert err.count("dtrain: error:") == 1 and last.startswith(
        f"dtrain: error: could not write {run_dir / 'model.safetensors'} (No space left on device), nor a "
        f"checkpoint of the trained state ("
    ), last
    assert last.endswith(
        f"; the trained weights are safe in {rescued[0]}: copy them to "
        f"{run_dir / 'model.safetensors'} once there is room"
    ), last
    assert_same_weights(reference, rescued[0].parent)
    assert not [p for p in run_dir.rglob("*") if p.name.startswith(".partial-") or p.name.endswith(".tmp")]


def test_a_disk_too_small_for_the_final_weights_is_refused_before_training(small_disk):
    run_dir = small_disk / "run"
    result = dtrain("run", *JOB, MODEL.replace("32", "60000") % "", "--nproc", "2", f"run.dir={run_dir}")  # 4 MB > 3 MB
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and re.fullmatch(
        rf"dtrain: error: run\.dir {re.escape(str(run_dir))} has [\d,]+ bytes free and the final "
        r"model\.safetensors needs [\d,]+; make room or choose a run\.dir on a bigger disk",
        lines[0],
    ), lines
    assert not run_dir.exists()  # nothing half-written: the run.dir the refused run made is gone again
