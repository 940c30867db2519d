"""What a run trained split (tensor or pipeline parallel) leaves behind, used as one process's is: `dtrain
eval` of its checkpoint (split as trained, or on one process) and of its final weights gives one process's
eval loss, and `dtrain generate` one process's text. Real runs and real launches on gloo; one tiny GPT
trained once per layout and shared by every test here."""

import json
import shutil

import pytest

from helpers import dtrain, eval_lines, ok

GPT = [
    "examples/gpt_stdlib.toml",
    "data.block_size=16",
    "data.batch_size=4",
    "training.max_steps=2",
    "training.grad_accum_steps=2",
    "training.log_every=1",
    "training.eval_batches=2",
    "data.eval_batch_size=4",
    "checkpoint.every_steps=2",
    "model.options={n_layer = 2, n_head = 2, n_embd = 32}",
]
LAYOUTS = {"one": ("1",), "tp2": ("2", "parallel.tp_size=2"), "pp2": ("2", "parallel.pp_size=2")}


@pytest.fixture(scope="module")
def runs(warm, json_byte_tokens, tmp_path_factory):
    """The same job on one process, under tp2 and under pp2 (one launch each)."""
    out = tmp_path_factory.mktemp("split")
    for layout, (nproc, *settings) in LAYOUTS.items():
        ok(warm("run", *GPT, f"data.path={json_byte_tokens}", f"run.dir={out / layout}", "--nproc", nproc, *settings))
    return out


def evaluated(run_dir, nproc: str, tmp_path) -> tuple[float, str]:
    """`dtrain eval RUN_DIR --nproc N`: its eval loss (from --out) and its stderr."""
    out = tmp_path / f"eval-{run_dir.name}-{nproc}.json"
    result = ok(dtrain("eval", str(run_dir), "--nproc", nproc, "--out", str(out)))
    record = json.loads(out.read_text())
    assert record["eval_samples"] == 8  # each sample once, however the model is split
    return record["eval_loss"], result.stderr


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_eval_of_a_split_run_gives_one_processs_eval_loss(runs, tmp_path, layout):
    """Split as trained, and on one process (the split taken back, said in one note): the loss the run
    logged, and one process's within 1e-5."""
    logged = eval_lines(runs / "one")[-1]["eval_loss"]
    assert eval_lines(runs / layout)[-1]["eval_loss"] == pytest.approx(logged, abs=1e-5)
    split, _ = evaluated(runs / layout, "2", tmp_path)
    assert split == pytest.approx(logged, abs=1e-5)
    alone, said = evaluated(runs / layout, "1", tmp_path)
    assert alone == pytest.approx(logged, abs=1e-5)
    key = "tp_size" if layout == "tp2" else "pp_size"
    assert [line for line in said.splitlines() if key in line] == [
        f"note: evaluating on 1 process: parallel.{key}=1 instead of the run's 2"
    ]


def test_eval_of_a_pipeline_runs_final_weights(runs, tmp_path):
    """The final model.safetensors (no checkpoint left) read stage by stage: one process's eval loss."""
    final = tmp_path / "pp2"
    shutil.copytree(runs / "pp2", final, ignore=shutil.ignore_patterns("checkpoints"))
    loss, _ = evaluated(final, "2", tmp_path)
    assert loss == pytest.approx(eval_lines(runs / "one")[-1]["eval_loss"], abs=1e-5)


def test_generate_from_a_pipeline_run_says_what_one_process_says(runs):
    """(A tp2 run's: test_tensor_parallel_takes_the_steps_one_process_takes.)"""
    greedy = ("--prompt", "{", "--tokens", "12", "--temperature", "0")
    said = ok(dtrain("generate", str(runs / "pp2"), *greedy)).stdout
    assert said and said == ok(dtrain("generate", str(runs / "one"), *greedy)).stdout
