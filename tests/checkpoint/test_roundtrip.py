"""A run's Hugging Face export read back by dtrain: fine-tuned as `model.name = "hf-causal-lm:RUN/hf"`,
continued by the built-in GPT (`model.init_from = RUN/hf`, GPT-2's layout read back into its names, also
under FSDP), and sampled by `dtrain generate` as transformers samples the export — on 2 real processes."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from dtrain.checkpoint import init_from
from dtrain.commands.generate import generate
from dtrain.errors import ConfigError, DtrainError
from dtrain.export.hf import export_hf
from dtrain.export.weights import load_weights, save_final_weights
from dtrain.models import described
from dtrain.models.gpt import GPT
from helpers import WORKERS, dtrain, ok, torchrun, train_lines

transformers = pytest.importorskip("transformers")  # the test extra installs it
sys.path.insert(0, str(Path(__file__).parent))
import test_init_from  # noqa: E402
from test_init_from import OPTIONS, first_batch_loss, gpt_loss, job  # noqa: E402

tokens = test_init_from.tokens  # the same token data (a fixture)


@pytest.fixture(scope="module")
def exported(pool, tokens, tmp_path_factory):
    """The built-in GPT trained 20 steps on 2 processes and exported at its end (run.dir/hf, GPT-2)."""
    run_dir = tmp_path_factory.mktemp("exported") / "run"
    ok(pool.run(*job(tokens, run_dir, OPTIONS, "training.max_steps=20", "checkpoint.export=hf")))
    return run_dir


@pytest.fixture(scope="module")
def fine_tuned(pool, exported, tokens, tmp_path_factory):
    """The export fine-tuned as a Hugging Face model for 2 steps, and exported in its turn."""
    run_dir = tmp_path_factory.mktemp("fine_tuned") / "run"
    ok(pool.run(*job(tokens, run_dir, f"model.name=hf-causal-lm:{exported / 'hf'}", "model.options={}",
                   "training.max_steps=2", "checkpoint.export=hf")))  # fmt: skip
    return run_dir


def one_step_noise(lines: list[dict]) -> float:
    """How far the loss moves from batch to batch where a run ended: the spread of its last 6 steps'
    losses (each step's on another batch)."""
    losses = [line["loss"] for line in lines[-6:]]
    return max(losses) - min(losses)


def test_a_fine_tuned_export_starts_where_its_run_ended_and_exports_again(exported, fine_tuned, tokens):
    from transformers import AutoModelForCausalLM

    ended = train_lines(exported)
    export = AutoModelForCausalLM.from_pretrained(exported / "hf").eval()
    began = train_lines(fine_tuned)[0]["loss"]
    # Its first loss is the export's own on that batch (so: the exported weights, read under HF's names)...
    assert began == pytest.approx(first_batch_loss(tokens, lambda x, _y: export(input_ids=x).logits), abs=1e-4)
    # ... which is where the exporting run ended, within the noise of one step, far from a new start.
    assert abs(began - ended[-1]["loss"]) <= one_step_noise(ended), (began, ended[-6:])
    assert began < ended[0]["loss"] - 1.0
    # It trains, and its own export loads again: the weights it ended with.
    again = AutoModelForCausalLM.from_pretrained(fine_tuned / "hf").eval()
    trained = load_weights(fine_tuned / "model.safetensors")
    assert all(torch.equal(again.state_dict()[name], tensor) for name, tensor in trained.items())
    assert not all(torch.equal(export.state_dict()[name], tensor) for name, tensor in trained.items())


def test_the_built_in_gpt_continues_from_its_gpt2_export_under_fsdp(pool, exported, tokens, tmp_path):
    """GPT-2's Conv1D weights are the built-in GPT's transposed: under FSDP each rank reads its rows of
    the GPT's tensor, the file's columns. c_proj is square: read untransposed it would fit, and be wrong."""
    ok(pool.run(*job(tokens, tmp_path / "run", OPTIONS, "training.max_steps=1", "parallel.strategy=fsdp",
                     f"model.init_from={exported / 'hf'}")))  # fmt: skip
    began = train_lines(tmp_path / "run")[0]["loss"]
    assert began == pytest.approx(gpt_loss(tokens, load_weights(exported / "model.safetensors")), abs=1e-4)


def test_fsdp_ranks_read_only_their_share_of_a_gpt2_export(tmp_path):
    import init_shards

    torch.manual_seed(0)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    model = init_shards.model()
    save_final_weights(model.state_dict(), run_dir / "model.safetensors")
    described.write(run_dir, model)
    folder = export_hf(run_dir)
    size = (folder / "model.safetensors").stat().st_size
    ok(torchrun(WORKERS / "init_shards.py", folder, tmp_path, run_dir / "model.safetensors"))
    for rank in (0, 1):
        facts = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert facts["same"]  # the shards hold the run's tensors, transposed back
        assert 0.95 * size < facts["whole"]["read"] < 1.1 * size
        assert 0.45 * size < facts["sharded"]["read"] < 0.6 * size, facts  # each rank reads its half
        assert facts["sharded"]["peak"] < 0.25 * size, facts


def small_gpt(bias: bool) -> GPT:
    return GPT(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16, bias=bias)


def test_biases_a_bias_less_gpt_has_not_are_taken_only_when_zero(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with_bias = small_gpt(bias=True)
    with torch.no_grad():
        with_bias.h[0].ln_1.bias.fill_(0.5)  # trained biases: the GPT initialises them to zero
        with_bias.h[0].mlp.c_fc.bias.normal_()
    save_final_weights(with_bias.state_dict(), run_dir / "model.safetensors")
    described.write(run_dir, with_bias)
    source = init_from.resolve("model.init_from", str(export_hf(run_dir)))
    with pytest.raises(
        ConfigError,
        match=r"has biases that are not zero \(h.0.ln_1.bias, h.0.mlp.c_fc.bias\) .* model.options.bias = true$",
    ):
        init_from.check_fit(small_gpt(bias=False), source)
    loaded = small_gpt(bias=True)
    init_from.load_into(loaded, source, is_main=True)  # the same GPT with biases reads them all
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in with_bias.state_dict().items())


def test_generate_samples_a_hugging_face_run_as_transformers_does(fine_tuned):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt, count = "def ", 20
    result = ok(dtrain("generate", str(fine_tuned), "--prompt", prompt, "--temperature", "0", "--tokens", str(count)))
    folder = fine_tuned / "hf"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = AutoModelForCausalLM.from_pretrained(folder).eval().generate(ids, do_sample=False, max_new_tokens=count)
    expected = prompt + tokenizer.decode(out[0, ids.shape[1] :])
    assert result.stdout.rstrip("\n") == expected
    # Sampling: the seed decides it.
    sampled = [generate(fine_tuned, prompt, count, 1.0, 5, seed) for seed in (1, 1, 2)]
    assert sampled[0] == sampled[1] != sampled[2]
    with pytest.raises(DtrainError, match=r"prompt's 4 tokens and --tokens 40 exceed the model's 32 positions"):
        generate(fine_tuned, prompt, 40)


def test_generate_refuses_a_model_that_cannot_generate_in_one_line(exported, fine_tuned, tmp_path):
    """A bare GPT2Model (`hf:` of a folder saved from one) has no head to sample from."""
    bare, run_dir = tmp_path / "bare", tmp_path / "run"
    shutil.copytree(fine_tuned / "hf", bare)
    config = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2Model"]}))
    shutil.copytree(fine_tuned, run_dir)
    text = (run_dir / "config.toml").read_text()
    (run_dir / "config.toml").write_text(
        text.replace(f'name = "hf-causal-lm:{exported / "hf"}"', f'name = "hf:{bare}"')
    )
    with pytest.raises(DtrainError) as refused:
        generate(run_dir, "def ")
    assert str(refused.value) == (
        f"model.name = 'hf:{bare}' builds a GPT2Model, which cannot generate; generate samples the built-in gpt "
        f"and hf-causal-lm: models"
    )
