"""A renamed config key: `distributed.fsdp_units` is now `model.blocks`. The old name alone still
works, with one note per job (not one per process that loads the config); both names are refused."""

import re

import pytest
import tomllib

from dtrain.config import load_config
from dtrain.errors import ConfigError
from helpers import ROOT, dtrain, ok

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
