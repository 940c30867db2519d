"""What run.dir may hold: dtrain writes beside nobody's files and over no earlier run unless told to, and a
run.dir that cannot be written is refused by the launcher — with real runs, real files and real mounts."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file, save_file

from helpers import ROOT, TIMEOUT, dtrain, env, mount_tmpfs, ok, run, train_lines, unmount

JOB = [
    "examples/digits_mlp.toml",
    "data.name=synthetic",
    "data.num_samples=200",
    "data.input_shape=[12]",
    "data.batch_size=32",
    "training.epochs=1",
    "training.log_every=1",
    "model.hidden_size=16",
]  # 5 steps, 1 process


def refused(result, message):
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert lines == [f"dtrain: error: {message}"], result.stderr


def snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def event_files(run_dir):
    return sorted((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_a_run_dir_holding_other_files_is_refused_unless_allowed(warm, cli, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("my notes")
    (run_dir / "data").mkdir()
    refused(
        cli("run", *JOB, f"run.dir={run_dir}"),
        f"run.dir {run_dir} holds files dtrain did not write (data, notes.txt); choose an empty or new "
        f"run.dir, or set run.allow_other_files=true to write beside them",
    )
    assert sorted(p.name for p in run_dir.iterdir()) == ["data", "notes.txt"]
    ok(warm("run", *JOB, f"run.dir={run_dir}", "run.allow_other_files=true"))
    assert (run_dir / "notes.txt").read_text() == "my notes" and (run_dir / "model.safetensors").is_file()


def test_a_fresh_start_over_an_earlier_run_is_refused_or_replaced(warm, tmp_path):
    """No checkpoint to continue from (checkpoint.at_end=false, weights from a dtrain older than their end
    record): a rerun would mix two runs in one TensorBoard and one metrics file. Refused, untouched; with
    run.overwrite=true the earlier outputs go first."""
    ok(warm("run", *JOB, f"run.dir={tmp_path}", "checkpoint.at_end=false"))
    weights = tmp_path / "model.safetensors"  # as an older dtrain wrote them: no record of the run's end
    save_file(load_file(weights), weights, metadata={"format": "pt", "written_by": "dtrain"})
    before = snapshot(tmp_path)
    refused(
        dtrain("run", *JOB, f"run.dir={tmp_path}", "optimizer.lr=0.01"),
        f"run.dir {tmp_path} holds an earlier run's outputs (metrics.jsonl, model.safetensors, tensorboard) and "
        f"no checkpoint to continue from; choose a new run.dir, or set run.overwrite=true to replace them",
    )
    assert snapshot(tmp_path) == before
    result = ok(warm("run", *JOB, f"run.dir={tmp_path}", "optimizer.lr=0.01", "run.overwrite=true"))
    assert (
        "replaced the outputs of the earlier run (run.overwrite): metrics.jsonl, model.safetensors, tensorboard"
        in result.stderr
    )
    assert len(event_files(tmp_path)) == 1  # one run in TensorBoard, not two
    assert [m["step"] for m in train_lines(tmp_path)] == [1, 2, 3, 4, 5]
    assert all(m["lr"] <= 0.01 for m in train_lines(tmp_path))  # the new run's, only


def test_overwrite_starts_afresh_even_over_checkpoints(warm, tmp_path):
    ok(warm("run", *JOB, f"run.dir={tmp_path}", "checkpoint.every_steps=2"))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-2", "step-4", "step-5"]
    resumed = ok(warm("run", *JOB, f"run.dir={tmp_path}"))  # without it: the finished run is found
    assert resumed.stderr.strip().splitlines() == [
        f"dtrain: run.dir {tmp_path} is already complete (step 5 of 5, epoch 1 of 1); nothing to train — raise "
        f"training.epochs or training.max_steps to train on"
    ]
    again = ok(warm("run", *JOB, f"run.dir={tmp_path}", "run.overwrite=true", "training.epochs=2"))
    assert "resumed" not in again.stderr
    assert [m["step"] for m in train_lines(tmp_path)] == list(range(1, 11))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-10"]  # the new run's end
    assert len(event_files(tmp_path)) == 1
    refused(
        dtrain("run", *JOB, f"run.dir={tmp_path}", "run.overwrite=true", "--resume"),
        "run.overwrite=true starts afresh and --resume (checkpoint.resume=yes) continues from a checkpoint: choose one",
    )


def test_a_restarted_group_replaces_its_first_attempts_outputs(tmp_path):
    """torchrun restarts the workers after a crash with no checkpoint yet: the same run again, whose
    outputs replace those of the attempt that died (no refusal, no second TensorBoard run)."""
    result = ok(
        dtrain(
            "run",
            *JOB,
            "model.name=faults:dying_mlp",
            "model.options={hidden_size = 16, die_at_forward = 4, die_rank = 1}",
            "--nproc",
            "2",
            "--max-restarts",
            "1",
            "training.epochs=2",
            f"run.dir={tmp_path}",
        )
    )
    assert "resumed" not in result.stderr
    assert "replaced the outputs of an earlier attempt of this run: metrics.jsonl, tensorboard" in result.stderr
    assert [m["step"] for m in train_lines(tmp_path)] == list(range(1, 7))  # 80 samples a rank: 3 steps an epoch
    assert len(event_files(tmp_path)) == 1


def test_a_run_killed_before_its_first_checkpoint_reruns_with_the_same_command(tmp_path):
    """kill -9 of the whole job (a scheduler's hard stop, the OOM killer) after a few steps, before any
    checkpoint: what it left (metrics, events) is the record of a run nothing can continue. The same
    command reruns — it replaces those outputs, says so in one line, and trains from step 1 — instead of
    being refused as an earlier run's outputs. A run that left weights is still refused (see above)."""
    command = [
        sys.executable,
        "-m",
        "dtrain",
        "run",
        *JOB,
        "model.name=faults:dying_mlp",
        "model.options={hidden_size = 16, step_sleep_s = 0.3}",
        "training.epochs=3",  # 3 steps an epoch on each of 2 ranks
        "--nproc",
        "2",
        f"run.dir={tmp_path}",
    ]
    job = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + TIMEOUT
    while not ((tmp_path / "metrics.jsonl").exists() and len(train_lines(tmp_path)) >= 2):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1]
        time.sleep(0.05)
    os.killpg(job.pid, signal.SIGKILL)
    job.communicate(timeout=TIMEOUT)
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "model.safetensors").exists()
    rerun = ok(run(command))
    replaced = [line for line in rerun.stderr.splitlines() if line.startswith("replaced the outputs")]
    assert replaced == [
        "replaced the outputs of an earlier run that ended before its first checkpoint (no checkpoint, no final "
        "weights): metrics.jsonl, tensorboard"
    ], rerun.stderr
    assert [m["step"] for m in train_lines(tmp_path)] == list(range(1, 10))  # the rerun's alone
    assert len(event_files(tmp_path)) == 1 and (tmp_path / "model.safetensors").is_file()


def test_the_rerun_after_a_hang_keeps_the_hangs_stacks(warm, tmp_path):
    """A hang before the first checkpoint (rank 1 stalls at its third step; the watchdog ends the job,
    124, with every rank's stacks in diagnostics/): the rerun replaces the metrics and events of that run,
    which nothing can continue, but keeps its diagnostics — what the rerun is for finding out."""
    job = [*JOB, "model.name=faults:dying_mlp", "training.epochs=2", "--nproc", "2", f"run.dir={tmp_path}"]
    hung = dtrain(
        "run",
        *job,
        "model.options={hidden_size = 16, stall_at_forward = 3, stall_rank = 1}",
        "distributed.hang_timeout_s=3",
    )
    assert hung.returncode == 124, hung.stderr
    stacks = (tmp_path / "diagnostics" / "rank-1.txt").read_text()
    assert "in stall_here_forever" in stacks
    rerun = ok(warm("run", *job, "model.options={hidden_size = 16}"))
    replaced = [line for line in rerun.stderr.splitlines() if line.startswith("replaced the outputs")]
    assert replaced == [
        "replaced the outputs of an earlier run that ended before its first checkpoint (no checkpoint, no final "
        "weights): metrics.jsonl, tensorboard"
    ], rerun.stderr
    assert (tmp_path / "diagnostics" / "rank-1.txt").read_text() == stacks
    assert [m["step"] for m in train_lines(tmp_path)] == list(range(1, 7))  # the rerun's alone


@pytest.mark.parametrize("left", ["unsealed", "sealed-aside"])
def test_only_a_run_that_left_no_sealed_checkpoint_anywhere_is_replaced(warm, tmp_path, left):
    """A run killed while writing its first checkpoint leaves it unsealed (no COMPLETE.json): nothing
    can resume it, and the rerun replaces it. One killed while replacing a sealed checkpoint of the same
    step leaves that one sealed under a partial name: lasting work, so the rerun is refused and
    nothing is touched."""
    ok(warm("run", *JOB, f"run.dir={tmp_path}", "checkpoint.every_steps=2"))
    (tmp_path / "model.safetensors").unlink()  # killed before the end
    for checkpoint in (tmp_path / "checkpoints").iterdir():
        if left == "unsealed":
            (checkpoint / "COMPLETE.json").unlink()
            checkpoint.rename(checkpoint.with_name(f".partial-{checkpoint.name}"))
        else:
            checkpoint.rename(checkpoint.with_name(f".partial-replaced-{checkpoint.name}"))
    before = snapshot(tmp_path)
    result = dtrain("run", *JOB, f"run.dir={tmp_path}")
    if left == "unsealed":
        ok(result)
        assert "replaced the outputs of an earlier run that ended before its first checkpoint" in result.stderr
        assert [m["step"] for m in train_lines(tmp_path)] == [1, 2, 3, 4, 5]
    else:
        assert result.returncode == 2 and "holds an earlier run's outputs" in result.stderr, result.stderr
        assert snapshot(tmp_path) == before


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a read-only filesystem needs root")
def test_a_run_dir_on_a_read_only_filesystem_is_refused_by_the_launcher(cli, tmp_path):
    """Root may write anywhere the mode bits forbid, never on a read-only mount: the launcher finds it."""
    mount = tmp_path / "ro"
    if not mount_tmpfs(mount, "1m", read_only=True):
        pytest.fail("mount -t tmpfs -o ro failed as root")
    try:
        result = cli("run", *JOB, f"run.dir={mount / 'run'}")
        refused(
            result,
            f"run.dir {mount / 'run'} cannot be written ({mount} is not a writable folder); choose another run.dir",
        )
        assert not re.search(r"rank \d", result.stderr)  # the launcher, before any worker
    finally:
        unmount(mount)


@pytest.mark.parametrize(
    "stranger, message",
    [
        ("checkpoints/bert.pt", "checkpoints is where dtrain writes its checkpoints, and it holds bert.pt"),
        (
            "tensorboard",
            "tensorboard is where dtrain writes its tensorboard, and it is not a folder (a file of yours?)",
        ),
        ("metrics.jsonl/data.txt", "metrics.jsonl is where dtrain writes its metrics.jsonl, and it is not a file"),
        (
            "model.safetensors",
            "model.safetensors is where dtrain writes its model.safetensors, and it is weights dtrain did not write",
        ),
        (
            "link:tensorboard",
            "tensorboard is where dtrain writes its tensorboard, and it is not a folder (a link of yours?)",
        ),
    ],
)
def test_what_only_shares_a_name_with_dtrains_outputs_is_never_deleted(cli, tmp_path, stranger, message):
    """run.overwrite and run.allow_other_files never make dtrain delete or write into what it did not
    write, even at one of its own names."""
    path = tmp_path / stranger.removeprefix("link:")
    path.parent.mkdir(parents=True, exist_ok=True)
    if stranger.startswith("link:"):
        (tmp_path / "mine").mkdir()
        path.symlink_to(tmp_path / "mine")
    elif stranger == "model.safetensors":
        import torch
        from safetensors.torch import save_file

        save_file({"w": torch.ones(2)}, str(path), metadata={"format": "pt"})  # someone's pretrained weights
    else:
        path.write_text("precious")
    before = snapshot(tmp_path)
    result = cli("run", *JOB, f"run.dir={tmp_path}", "run.overwrite=true", "run.allow_other_files=true")
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert snapshot(tmp_path) == before


def test_overwrite_deletes_nothing_when_the_run_is_refused_after_all(warm, tmp_path):
    ok(warm("run", *JOB, f"run.dir={tmp_path}", "checkpoint.every_steps=2"))
    before = snapshot(tmp_path)
    result = dtrain("run", *JOB, f"run.dir={tmp_path}", "run.overwrite=true", "model.name=os:getcwd")
    assert result.returncode == 2 and "returned str, not a torch.nn.Module" in result.stderr, result.stderr
    assert snapshot(tmp_path) == before


def test_a_lock_that_is_a_symlink_is_refused_and_its_target_untouched(cli, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".lock").symlink_to(victim)
    result = cli("run", *JOB, f"run.dir={run_dir}")
    assert result.returncode == 2, result.stderr
    assert (
        f"run.dir {run_dir}: .lock is where dtrain writes its .lock, and it is not dtrain's lock file" in result.stderr
    )
    assert victim.read_text() == "mine"


@pytest.mark.parametrize("where", ["/", "~"])
def test_the_root_and_home_folders_are_never_a_run_dir(cli, where):
    shown = os.path.expanduser(where)
    refused(
        cli("run", *JOB, f"run.dir={where}", "run.allow_other_files=true", "run.overwrite=true"),
        f"run.dir {shown} is {'the root folder' if where == '/' else 'your home folder'}; give the run a "
        f"folder of its own, e.g. run.dir=runs/first",
    )


def test_the_api_refuses_before_training_what_the_launcher_would(tmp_path):
    """dtrain.Trainer without the launcher: a folder in the way of the final weights is found before the
    first step, in one DtrainError."""
    import torch
    from torch.utils.data import TensorDataset

    import dtrain

    (tmp_path / "model.safetensors").mkdir()
    config = dtrain.Config.from_dict({"run": {"dir": str(tmp_path)}, "training": {"epochs": 1}})
    model = torch.nn.Linear(3, 2)
    x = torch.randn(16, 3)
    trainer = dtrain.Trainer(config, model=model, train_data=TensorDataset(x, (x[:, 0] > 0).long()))
    with pytest.raises(
        dtrain.DtrainError,
        match="model.safetensors is not a file \\(a folder\\?\\), and the run writes its final weights there",
    ):
        trainer.fit()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # no lock, no outputs left


def test_the_room_asked_for_the_final_weights_is_what_the_file_takes(tmp_path):
    """The GPT ties its output layer to its token embedding: the file holds that tensor once, so the
    room asked for beforehand must not count it twice (a run that fits would be refused)."""
    from dtrain.export.weights import save_final_weights
    from dtrain.models.gpt import GPT
    from dtrain.rundir.claim import weights_bytes

    model = GPT(512, block_size=32, n_layer=2, n_head=2, n_embd=32)
    save_final_weights(model.state_dict(), tmp_path / "model.safetensors")
    written = (tmp_path / "model.safetensors").stat().st_size
    assert written <= weights_bytes(model) <= written + (64 << 10)
