"""Settings that do nothing in the job at hand (another strategy's options, the mlp's width for another
model, blocks nothing works on) are named in one note, said once per job; blocks that name no module of
the model are refused in one line instead of being ignored."""

import pytest

from helpers import SMALL_JOB, dtrain, gpt_on_tokens, ok

IDLE = "note: these settings do nothing in this job and are ignored: "


@pytest.mark.parametrize(
    "overrides, said",
    [
        (
            [
                "parallel.fsdp_cpu_offload=true",
                "parallel.reshard_after_forward=false",
                "parallel.hsdp_shard_size=2",
                'model.blocks=["Linear"]',
            ],
            "parallel.reshard_after_forward = false (an FSDP setting; parallel.strategy = ddp); "
            "parallel.fsdp_cpu_offload = true (an FSDP setting; parallel.strategy = ddp); "
            "parallel.hsdp_shard_size = 2 (an hsdp setting; parallel.strategy = ddp); "
            'model.blocks = ["Linear"] (DDP uses blocks only for training.activation_checkpointing and '
            "training.compile=blocks, both off)",
        ),
        (
            [
                "parallel.strategy=fsdp",
                "ddp.static_graph=true",
                "ddp.bucket_cap_mb=50",
                "ddp.shared_memory_allreduce=false",
                "parallel.hsdp_shard_size=2",
                "model.name=cnn",
                "model.hidden_size=3",
            ],
            "ddp.bucket_cap_mb = 50.0 (a DDP setting; parallel.strategy = fsdp); "
            "ddp.static_graph = true (a DDP setting; parallel.strategy = fsdp); "
            "ddp.shared_memory_allreduce = false (a DDP setting; parallel.strategy = fsdp); "
            "parallel.hsdp_shard_size = 2 (an hsdp setting; parallel.strategy = fsdp); "
            "model.hidden_size = 3 (the built-in mlp's width; model.name = cnn)",
        ),
        (
            ["data.pad_to_multiple_of=8", "data.pad_token_id=0"],
            "data.pad_to_multiple_of = 8 (a padding setting; data.padding = none); "
            "data.pad_token_id = 0 (a padding setting; data.padding = none)",
        ),
        # Each of these does something here: nothing to say.
        (["parallel.strategy=fsdp", "parallel.fsdp_cpu_offload=true", 'model.blocks=["Linear"]'], None),
        (
            ["parallel.strategy=hsdp", "parallel.hsdp_shard_size=2", "parallel.reshard_after_forward=false"],
            None,
        ),
        (['model.blocks=["Linear"]', "training.activation_checkpointing=full"], None),
        (["data.padding=longest", "data.pad_to_multiple_of=8", "data.pad_token_id=0"], None),
        (['model.blocks=["Linear"]', "training.compile=blocks", "ddp.static_graph=true"], None),
    ],
)
def test_settings_that_do_nothing_are_named_in_one_note(overrides, said):
    result = ok(dtrain("config", "examples/digits_mlp.toml", *overrides))
    assert result.stderr.splitlines() == ([IDLE + said] if said else [])


def test_shuffle_under_random_windows_is_named_in_the_note():
    result = ok(dtrain("config", "examples/gpt_stdlib.toml", "data.sampling=random", "data.shuffle=false"))
    said = "data.shuffle = false (random windows are drawn at random; data.sampling = random)"
    assert result.stderr.splitlines() == [IDLE + said]


def test_pipeline_settings_without_a_pipeline_are_named_in_the_note():
    result = ok(dtrain("config", "examples/gpt_stdlib.toml", "parallel.pp_schedule=gpipe", "parallel.pp_split=count"))
    why = "(a pipeline setting; parallel.pp_size = 1)"
    said = f'parallel.pp_schedule = "gpipe" {why}; parallel.pp_split = "count" {why}'
    assert result.stderr.splitlines() == [IDLE + said]
    assert (
        ok(dtrain("config", "examples/gpt_stdlib.toml", "parallel.pp_schedule=gpipe", "parallel.pp_size=2")).stderr
        == ""
    )


def test_a_run_says_the_note_once_and_refuses_blocks_naming_no_module(tmp_path):
    """Under `dtrain run --nproc 2` (the launcher and both workers read the config) the note is said once;
    a model.blocks name that matches no module is refused even where nothing would use the blocks (DDP
    without activation checkpointing or compile=blocks), naming what matched and the model's classes."""
    result = dtrain(
        "run",
        *SMALL_JOB,
        "--nproc",
        "2",
        f"run.dir={tmp_path / 'run'}",
        "parallel.fsdp_cpu_offload=true",
        'model.blocks=["Linear", "Linera"]',
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        IDLE + "parallel.fsdp_cpu_offload = true (an FSDP setting; parallel.strategy = ddp); "
        'model.blocks = ["Linear", "Linera"] (DDP uses blocks only for training.activation_checkpointing and '
        "training.compile=blocks, both off)",
        "dtrain: error: model.blocks = ['Linear', 'Linera']: Linera names no module of this model (Linear "
        "matched 2 modules); its module classes are Flatten, Linear, ReLU",
    ]
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_fsdp_over_one_data_parallel_process_is_said_to_shard_nothing(warm, json_byte_tokens, tmp_path):
    """tp 2 on 2 processes leaves one data-parallel process: FSDP has nothing to shard over, said once."""
    args = ["parallel.tp_size=2", "parallel.strategy=fsdp", "training.max_steps=1"]
    args += ["model.options={n_layer = 2, n_head = 2, n_embd = 32}"]
    err = ok(warm(*gpt_on_tokens(json_byte_tokens, tmp_path / "run", *args, block=16))).stderr
    note = (
        "note: parallel.strategy = fsdp shards over the data-parallel processes and this job has one "
        "(2 processes, each a tensor or pipeline part of one replica): it shards nothing"
    )
    assert err.count(note) == 1, err
