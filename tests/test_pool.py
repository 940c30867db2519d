"""The warm workers many tests run their jobs on (tests/pool.py) must run a job exactly as the command
does: the same weights, the same logged numbers, the same files, and what the launcher alone says."""

import json

import pytest
import torch

from helpers import SMALL_JOB, WORKERS, dtrain, metrics, ok, torchrun, weights

NUMBERS = ("loss", "lr", "eval_loss", "eval_accuracy", "train_loss")


def logged(run_dir):
    return [{k: m[k] for k in ("step", *NUMBERS) if k in m} for m in metrics(run_dir) if "step" in m]


def files(run_dir):
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if "tensorboard" not in p.parts)


def test_a_job_on_the_pool_is_the_job_the_command_runs(pool, solo, tmp_path):
    for workers, nproc in ((pool, "2"), (solo, "1")):
        job = [*SMALL_JOB, "--nproc", nproc, "checkpoint.every_steps=5"]
        launched, pooled = tmp_path / f"launched-{nproc}", tmp_path / f"pooled-{nproc}"
        ok(dtrain("run", *job, f"run.dir={launched}"))
        said = ok(workers.run("run", *job, f"run.dir={pooled}")).stderr
        assert "eval_accuracy" in said and "checkpoint step-" in said, said  # rank 0's lines, as on a console
        a, b = weights(launched), weights(pooled)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert logged(launched) == logged(pooled) and files(launched) == files(pooled)
        # The launcher's own part: a rerun of the finished run is said complete before any worker starts.
        again = ok(workers.run("run", *job, f"run.dir={pooled}"))
        assert f"run.dir {pooled} is already complete" in again.stderr and "resumed" not in again.stderr


def test_a_job_failing_in_the_workers_is_reported_and_the_next_job_gets_a_new_pool(pool, tmp_path):
    """A failure in the workers may leave the group broken: the pool says the failure as the command would
    (exit 1 here, rank 1's traceback), ends, and the next job runs on a new pair of workers."""
    failed = pool.run(
        "run", *SMALL_JOB, "--nproc", "2", "data.name=user_factories:explode", f"run.dir={tmp_path / 'a'}"
    )
    assert failed.returncode == 1 and "RuntimeError: data factory exploded" in failed.stdout + failed.stderr
    ok(pool.run("run", *SMALL_JOB, "--nproc", "2", f"run.dir={tmp_path / 'b'}"))
    assert (tmp_path / "b" / "model.safetensors").is_file()


def test_a_script_on_the_pool_is_the_script_torchrun_and_dtrain_launch_run(warm, warm_torchrun, tmp_path):
    """`torchrun SCRIPT` (the script forms and destroys its own group) and `dtrain launch SCRIPT` (through
    dtrain.worker.script, the launcher's checks first): the same results on the warm workers."""
    pytest.importorskip("transformers")  # the test extra installs it
    launched, pooled = tmp_path / "torchrun", tmp_path / "torchrun-pooled"
    ok(torchrun(WORKERS / "batch_shapes.py", launched))
    ok(warm_torchrun(WORKERS / "batch_shapes.py", pooled))
    assert json.loads((launched / "results.json").read_text()) == json.loads((pooled / "results.json").read_text())

    pytest.importorskip("datasets")
    script = [str(WORKERS / "hf_data.py")]
    launched, pooled = tmp_path / "launch", tmp_path / "launch-pooled"
    said = [
        ok(start("launch", "--nproc", "2", *script, str(out), "loader"))
        for start, out in ((dtrain, launched), (warm, pooled))
    ]
    assert said[0].returncode == said[1].returncode == 0
    a, b = weights(launched / "run"), weights(pooled / "run")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert logged(launched / "run") == logged(pooled / "run")
    for rank in (0, 1):
        seen = f"seen-rank{rank}.json"
        assert (launched / seen).read_text() == (pooled / seen).read_text()
    # The launcher's own refusal, before any worker: said once, nothing run.
    missing = warm("launch", "--nproc", "2", str(tmp_path / "nowhere.py"))
    assert missing.returncode == 2 and missing.stderr.count("nowhere.py does not exist") == 1, missing.stderr
