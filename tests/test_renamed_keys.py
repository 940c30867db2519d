"""Renamed config keys: `distributed.fsdp_units` is now `model.blocks`, and [distributed]'s keys of the
layout and of DDP moved to [parallel] and [ddp]. The old names alone still work, with one note per job
(not one per process that loads the config); both names are refused. A run.dir written before the move
resumes (tests/fixtures/before_parallel_section: written by the code before it)."""

import re
import shutil

import pytest
import tomllib
import torch
from safetensors.torch import load_file

from dtrain.config import load_config
from dtrain.errors import ConfigError
from helpers import ROOT, dtrain, eval_lines, ok

BEFORE_THE_SPLIT = ROOT / "tests" / "fixtures" / "before_parallel_section"

NOTE = (
    "distributed.fsdp_units is now model.blocks; the value {where} was used as model.blocks: write model.blocks instead"
)


def job_with(tmp_path, extra: str):
    job = tmp_path / "job.toml"
    job.write_text((ROOT / "examples" / "digits_mlp.toml").read_text() + extra)
    return job


def test_the_old_key_still_sets_the_blocks_with_one_note_per_job(tmp_path):
    """Under `dtrain run --nproc 2` the launcher and both workers load the config: the note is said once.
    The old key took effect: activation checkpointing finds the MLP's Linear layers as its blocks (the
    plain MLP has none dtrain can find, and is refused)."""
    job = job_with(tmp_path, '\n[distributed]\nfsdp_units = ["Linear"]\n')
    run_dir = tmp_path / "run"
    result = ok(
        dtrain(
            "run",
            str(job),
            "--nproc",
            "2",
            f"run.dir={run_dir}",
            "training.activation_checkpointing=full",
            "training.max_steps=2",
            "training.log_every=1",
            "monitor.trackers=[]",
        )
    )
    note = "note: " + NOTE.format(where=f"in {job}")
    said = [line for line in result.stderr.splitlines() if "fsdp_units" in line]
    assert said == [note], result.stderr
    assert "FutureWarning" not in result.stderr
    written = tomllib.loads((run_dir / "config.toml").read_text())
    assert written["model"]["blocks"] == ["Linear"] and "fsdp_units" not in written["distributed"]


def test_dtrain_config_prints_model_blocks_and_notes_the_old_name_once(tmp_path):
    result = ok(dtrain("config", 'distributed.fsdp_units=["Block"]'))
    assert re.search(r'^blocks = \[\s*"Block",?\s*\]', result.stdout, re.M), result.stdout
    assert "fsdp_units" not in result.stdout
    assert result.stderr.splitlines() == [
        "note: " + NOTE.format(where="on the command line"),
        'note: these settings do nothing in this job and are ignored: model.blocks = ["Block"] (DDP uses blocks '
        "only for training.activation_checkpointing and training.compile=blocks, both off)",
    ]


@pytest.mark.parametrize("where", ["file", "command line"])
def test_both_names_are_refused_in_one_line(tmp_path, where):
    if where == "file":
        job = job_with(tmp_path, '\n[distributed]\nfsdp_units = ["Linear"]\n').read_text()
        job = job.replace("hidden_size = 1024", 'hidden_size = 1024\nblocks = ["Linear"]')
        path = tmp_path / "both.toml"
        path.write_text(job)
        result = dtrain("config", str(path))
        source = f"in {path}"
    else:
        result = dtrain("config", 'distributed.fsdp_units=["Linear"]', 'model.blocks=["Linear"]')
        source = "on the command line"
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"dtrain: error: distributed.fsdp_units and model.blocks {source} are one setting "
        f"(distributed.fsdp_units is its old name); give only model.blocks"
    ], result.stderr


def test_a_library_user_gets_a_future_warning(tmp_path):
    job = job_with(tmp_path, '\n[distributed]\nfsdp_units = ["Linear"]\n')
    with pytest.warns(FutureWarning, match=re.escape(NOTE.format(where=f"in {job}"))):
        config = load_config(job)
    assert config.model.blocks == ["Linear"]
    with pytest.raises(ConfigError, match="are one setting"):
        load_config(job, ['model.blocks=["Linear"]', 'distributed.fsdp_units=["Linear"]'])


def test_a_run_dir_and_config_written_before_the_parallel_section_resume_with_one_note(warm, tmp_path):
    """The fixture is a run of 2 processes under FSDP (reshard_after_forward = false) of 4 steps, stopped at
    step 2 by the code before [parallel] and [ddp] existed: its config.toml says all twenty keys under
    [distributed], its checkpoint's setup names distributed.strategy. That config, given again, resumes the
    run with one note naming the moves; it ends with the weights of the same run trained in one go under
    the new names. Resumed under DDP instead, the checkpoint's old names are read as the new ones: the
    change of strategy is said."""
    old_job = tmp_path / "old.toml"
    shutil.copy(BEFORE_THE_SPLIT / "config.toml", old_job)
    assert "strategy" in tomllib.loads(old_job.read_text())["distributed"]
    resumed, moved_to_ddp = tmp_path / "resumed", tmp_path / "moved_to_ddp"
    for copy in (resumed, moved_to_ddp):
        shutil.copytree(BEFORE_THE_SPLIT, copy)
    go_on = ["--nproc", "2", "training.stop_at_step=0", "monitor.trackers=[]"]
    result = ok(warm("run", str(old_job), f"run.dir={resumed}", *go_on))
    notes = [line for line in result.stderr.splitlines() if "moved" in line]
    assert notes == [
        f"note: 16 keys in {old_job} have moved (strategy, reshard_after_forward, fsdp_cpu_offload, "
        "hsdp_shard_size, tp_size, pp_size, pp_schedule, pp_stages_per_rank, pp_split, cp_size from [distributed] "
        "to [parallel]; bucket_cap_mb, gradient_as_bucket_view, static_graph, find_unused_parameters, "
        "shared_memory_allreduce, comm_hook from [distributed] to [ddp]): read under their new names; write them "
        "there instead"
    ], result.stderr
    assert f"resumed from {resumed / 'checkpoints' / 'step-2'}" in result.stderr
    assert "config changed" not in result.stderr  # fsdp then and now: the old names are the new ones
    written = tomllib.loads((resumed / "config.toml").read_text())
    assert written["parallel"]["strategy"] == "fsdp" and "strategy" not in written["distributed"]

    new_job = tmp_path / "new.toml"
    new_job.write_text((resumed / "config.toml").read_text())  # the same run, said under the new names
    in_one_go = tmp_path / "in_one_go"
    result = ok(warm("run", str(new_job), f"run.dir={in_one_go}", *go_on))
    assert "moved" not in result.stderr and "note: 1" not in result.stderr
    weights, again = load_file(resumed / "model.safetensors"), load_file(in_one_go / "model.safetensors")
    assert weights.keys() == again.keys() and all(torch.equal(weights[k], again[k]) for k in weights)
    assert eval_lines(resumed)[-1]["eval_loss"] == eval_lines(in_one_go)[-1]["eval_loss"]

    result = ok(warm("run", str(old_job), f"run.dir={moved_to_ddp}", "parallel.strategy=ddp", *go_on))
    assert "the config changed since that checkpoint (parallel.strategy fsdp → ddp)" in result.stderr


def test_old_names_from_a_file_and_the_command_line_are_one_note_and_errors_name_what_was_typed(cli, tmp_path):
    """However many old names a job gives, and wherever (a file, the command line, the same key twice), one
    note says them; a refused value given under an old name says that name too; a misspelt old name is
    answered with the new one."""
    job = job_with(tmp_path, '\n[distributed]\nstrategy = "fsdp"\nbucket_cap_mb = 10.0\n')
    said = cli("config", str(job), "distributed.tp_size=1", "distributed.tp_size=1")
    assert said.returncode == 0, said.stderr
    moved = [line for line in said.stderr.splitlines() if "moved" in line]
    assert moved == [
        f"note: 3 keys in {job} and on the command line have moved (strategy, tp_size from [distributed] to "
        "[parallel]; bucket_cap_mb from [distributed] to [ddp]): read under their new names; write them there "
        "instead"
    ], said.stderr
    refused = cli("config", "distributed.tp_size=0")
    assert refused.returncode == 2
    assert refused.stderr.splitlines() == [
        "dtrain: error: parallel.tp_size must be >= 1; got 0 (given as distributed.tp_size, its old name)"
    ]
    for typed, meant in [("distributed.stratgy", "parallel.strategy"), ("parallel.timeout_s", "distributed.timeout_s")]:
        answer = cli("config", f"{typed}=1")
        assert answer.returncode == 2 and f"did you mean '{meant}'?" in answer.stderr, answer.stderr
