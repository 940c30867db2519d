"""A non-default optimizer, parameter groups and a schedule on 2 processes through the real launcher:
stopped and resumed, the run ends bit for bit as the uninterrupted one; FSDP2 builds the same groups as
DDP (the model's own names); a resumed run whose schedule changed follows its config and says so."""

import re
import shutil

import torch

from helpers import SMALL_JOB, ok, train_lines, weights

RECIPE = [
    *SMALL_JOB,
    "training.log_every=1",
    "optimizer.name=AdamW",
    "optimizer.lr=0.01",
    "optimizer.weight_decay=0.1",
    "optimizer.betas=[0.9, 0.95]",
    "optimizer.groups=[{params = '3.*', lr = 0.003}]",
    "scheduler.name=cosine",
    "scheduler.warmup_steps=3",
    "scheduler.decay_steps=12",
    "scheduler.min_lr=0.001",
]


def launch(warm, run_dir, *extra, strategy="ddp"):
    return ok(warm("run", *RECIPE, f"parallel.strategy={strategy}", *extra, "--nproc", "2", f"run.dir={run_dir}"))


def test_groups_and_schedule_stop_and_resume_bitwise_under_ddp_and_fsdp(warm, tmp_path):
    whole = tmp_path / "whole"
    launch(warm, whole)
    lines = train_lines(whole)
    assert [m["step"] for m in lines] == list(range(1, 17))
    assert lines[0]["lr"] == 0.0 and lines[3]["lr"] == 0.01  # warm-up as transformers', then the peak
    assert all(abs(m["lr"] - 0.001) < 1e-12 for m in lines[12:])  # past scheduler.decay_steps: min_lr
    # Stopped at step 7 (the checkpoint a SIGTERM writes), then rerun: the same run, bit for bit.
    stopped = tmp_path / "stopped"
    launch(warm, stopped, "training.stop_at_step=7")
    changed = tmp_path / "changed"
    shutil.copytree(stopped, changed)
    launch(warm, stopped)
    assert [(m["step"], m["loss"], m["lr"]) for m in train_lines(stopped)] == [
        (m["step"], m["loss"], m["lr"]) for m in lines
    ]
    for name, tensor in weights(whole).items():
        assert torch.equal(tensor, weights(stopped)[name]), name
    # FSDP2 shards the parameters; the groups are matched on the model's own names all the same.
    sharded = tmp_path / "fsdp"
    launch(warm, sharded, strategy="fsdp")
    for a, b in zip(lines, train_lines(sharded)):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 and a["lr"] == b["lr"], (a, b)
    for name, tensor in weights(whole).items():
        torch.testing.assert_close(weights(sharded)[name], tensor, atol=1e-5, rtol=1e-5)
    # The config governs on resume: a shorter decay rebuilds the schedule at step 7, and the console says so.
    result = launch(warm, changed, "scheduler.decay_steps=9")
    assert re.search(
        r"the config changed since that checkpoint \(scheduler.decay_steps 12 → 9\): this run follows it from "
        r"step 7, the learning-rate schedule rebuilt for its plan",
        result.stderr,
    ), result.stderr
    after = train_lines(changed)
    assert [m["lr"] for m in after[:7]] == [m["lr"] for m in lines[:7]]
    assert all(abs(m["lr"] - 0.001) < 1e-12 for m in after[9:]) and after[8]["lr"] < lines[8]["lr"]
