"""The warm workers many tests run their jobs on (tests/pool.py) must run a job exactly as the command
does: the same weights, the same logged numbers, the same files, and what the launcher alone says."""

import torch

from helpers import SMALL_JOB, dtrain, metrics, ok, weights

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
