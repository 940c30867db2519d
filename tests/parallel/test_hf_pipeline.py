"""A Hugging Face model under pipeline parallel is refused by the launcher in one line: its forward runs
every block, and a stage holds only some of them."""

import pytest

from helpers import dtrain, gpt_on_tokens

transformers = pytest.importorskip("transformers")  # the test extra installs it


def test_a_hugging_face_model_under_pipeline_parallel_is_refused_first_in_one_line(json_byte_tokens, tmp_path):
    folder = tmp_path / "gpt2"
    config = transformers.GPT2Config(vocab_size=257, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    # grad_accum_steps = 1 is wrong for 2 stages too: the Hugging Face reason comes first.
    args = [f"model.name=hf:{folder}", "parallel.pp_size=2", "training.grad_accum_steps=1", "training.max_steps=2"]
    result = dtrain(*gpt_on_tokens(json_byte_tokens, tmp_path / "run", *args, block=16))
    message = (
        f"parallel.pp_size = 2 with model.name = 'hf:{folder}': a Hugging Face model's forward does not "
        f"pass over the blocks a pipeline stage lacks; set parallel.pp_size=1"
    )
    assert result.returncode == 2, result.stderr
    assert [line for line in result.stderr.splitlines() if line.strip()] == [f"dtrain: error: {message}"]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
