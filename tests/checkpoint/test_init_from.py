"""Starting a run from weights: `model.init_from` (a model.safetensors, a run.dir, a checkpoint) and
`model.name = "hf:PATH"` / `"hf-causal-lm:PATH"` (a Hugging Face model folder), on 2 real processes.

A run's first logged loss is the loss of its first global batch under the weights it started from: each
test computes that loss itself, from the file, and compares."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from dtrain.checkpoint import init_from
from dtrain.checkpoint.tensors import read_model_weights
from dtrain.data.sampler import GlobalOrderSampler
from dtrain.data.tokens import TokenWindows
from dtrain.errors import ConfigError
from dtrain.export.weights import load_weights
from dtrain.models.gpt import GPT
from helpers import WORKERS, dtrain, gpt_on_tokens, ok, torchrun, train_lines

BATCH, BLOCK = 4, 32  # per process; 2 processes
OPTIONS = "model.options={n_layer = 2, n_head = 2, n_embd = 32}"


def job(tokens: Path, run_dir: Path, *args: str) -> list[str]:
    return gpt_on_tokens(tokens, run_dir, "scheduler.warmup_steps=2", *args, block=BLOCK, batch=BATCH)


@pytest.fixture(scope="module")
def tokens(json_byte_tokens):
    return json_byte_tokens


@pytest.fixture(scope="module")
def first(pool, tokens, tmp_path_factory):
    """A built-in GPT trained 20 steps (checkpoints at 10 and 20), whose weights the others start from."""
    run_dir = tmp_path_factory.mktemp("first") / "run"
    ok(pool.run(*job(tokens, run_dir, OPTIONS, "training.max_steps=20", "checkpoint.every_steps=10")))
    return run_dir


def first_batch_loss(tokens: Path, logits_of, step: int = 1) -> float:
    """The mean cross-entropy over the first global batch (2 processes × BATCH windows: the same batch
    whatever the world size), or that of another `step`, every position scored against its next token,
    as dtrain's loss is."""
    windows = TokenWindows(str(tokens), "train", BLOCK)
    order = GlobalOrderSampler(len(windows), 0, 1, 2 * BATCH, seed=0).shard(0)[(step - 1) * 2 * BATCH :][: 2 * BATCH]
    x, y = (torch.stack(part) for part in zip(*(windows[int(i)] for i in order), strict=True))
    with torch.no_grad():
        return F.cross_entropy(logits_of(x.long(), y.long()).flatten(0, 1), y.long().flatten()).item()


def gpt() -> GPT:
    return GPT(vocab_size=257, block_size=BLOCK, n_layer=2, n_head=2, n_embd=32)


def gpt_loss(tokens: Path, state: dict[str, torch.Tensor], step: int = 1) -> float:
    model = gpt()
    model.load_state_dict(state)
    return first_batch_loss(tokens, lambda x, _y: model(x), step)


def test_a_new_run_starts_from_a_run_s_weights_and_from_its_checkpoint_a_resumed_one_not(pool, first, tokens, tmp_path):
    ended = train_lines(first)
    # FSDP: each rank reads its rows of the file.
    ok(pool.run(*job(tokens, tmp_path / "b", OPTIONS, "training.max_steps=1", "parallel.strategy=fsdp",
                   f"model.init_from={first / 'model.safetensors'}")))  # fmt: skip
    began = train_lines(tmp_path / "b")[0]["loss"]
    assert began == pytest.approx(gpt_loss(tokens, load_weights(first / "model.safetensors")), abs=1e-4)
    # It continues where the first run ended (its last step's loss, on another batch), far from a new start.
    assert abs(began - ended[-1]["loss"]) < 0.3 and began < ended[0]["loss"] - 1.0
    # DDP from a checkpoint folder: DCP reads it, whatever wrote it. Stopped after a step...
    step10, run_c = first / "checkpoints" / "step-10", tmp_path / "c"
    c_job = job(tokens, run_c, OPTIONS, "training.max_steps=2")
    ok(pool.run(*c_job, "training.stop_at_step=1", f"model.init_from={step10}"))
    read_model_weights(step10, state := gpt().state_dict())
    assert train_lines(run_c)[0]["loss"] == pytest.approx(gpt_loss(tokens, state), abs=1e-4)
    # ... and resumed: its checkpoint governs, and model.init_from (other weights now) is not read.
    ok(pool.run(*c_job, f"model.init_from={first / 'model.safetensors'}"))
    read_model_weights(run_c / "checkpoints" / "step-1", state := gpt().state_dict())
    assert [line["step"] for line in train_lines(run_c)] == [1, 2]
    assert train_lines(run_c)[1]["loss"] == pytest.approx(gpt_loss(tokens, state, step=2), abs=1e-4)


def test_what_a_path_names_is_told_apart(first, tmp_path):
    assert init_from.resolve("k", str(first)).files == (first / "model.safetensors",)
    assert init_from.resolve("k", str(first / "checkpoints/step-10")).checkpoint == first / "checkpoints/step-10"
    shutil.copytree(first / "checkpoints", tmp_path / "unfinished" / "checkpoints")  # no final weights yet
    assert init_from.resolve("k", str(tmp_path / "unfinished")).checkpoint == (
        tmp_path / "unfinished" / "checkpoints" / "step-20"
    )
    for bad, why in [
        (tmp_path / "nothing", "does not exist"),
        (first / "metrics.jsonl", "is not a safetensors file"),
        (tmp_path, "is a folder with no weights dtrain can read"),
    ]:
        with pytest.raises(ConfigError, match=why):
            init_from.resolve("model.init_from", str(bad))


def tiny_llama_config(tied: bool):
    """A Llama small enough for the suite; `tied`: its head is its embedding (one tensor in the file)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=257,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2 * BLOCK,
        tie_word_embeddings=tied,
    )


def tiny_hf(kind: str, folder: Path):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

    torch.manual_seed(3)
    if kind == "gpt2":
        config = GPT2Config(
            vocab_size=257, n_positions=2 * BLOCK, n_embd=32, n_layer=2, n_head=2, bos_token_id=256, eos_token_id=256
        )
        model = GPT2LMHeadModel(config)
    else:
        model = LlamaForCausalLM(tiny_llama_config(tied=False))
    # Llama's folder in shards with an index, as large models are saved.
    model.save_pretrained(folder, max_shard_size="50KB" if kind == "llama" else "5GB")
    assert (folder / "model.safetensors.index.json").is_file() == (kind == "llama")
    return model


# GPT-2's dropout (0.1 in its config) turned off through model.options, as from_pretrained(**kwargs) would.
NO_DROPOUT = "model.options={resid_pdrop = 0.0, embd_pdrop = 0.0, attn_pdrop = 0.0}"


@pytest.mark.parametrize(
    "kind, name, options, strategy",
    [("gpt2", "hf-causal-lm", NO_DROPOUT, "ddp"), ("llama", "hf", "model.options={}", "fsdp")],
    ids=["gpt2", "llama"],
)
def test_a_hugging_face_folder_trains_from_its_own_weights(pool, tokens, tmp_path, kind, name, options, strategy):
    from transformers import AutoModelForCausalLM

    tiny_hf(kind, tmp_path / "hf")
    run_dir = tmp_path / "run"
    ok(pool.run(*job(tokens, run_dir, f"model.name={name}:{tmp_path / 'hf'}", options,
                   "training.max_steps=2", f"parallel.strategy={strategy}")))  # fmt: skip
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()

    def own_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # The model's own loss given labels (it shifts them itself) over the window and its next token
        # equals dtrain's scoring of every position against the next token.
        ids = torch.cat([x, y[:, -1:]], dim=1)
        loss = loaded(input_ids=ids, labels=ids).loss.item()
        logits = loaded(input_ids=x).logits
        assert F.cross_entropy(logits.flatten(0, 1), y.flatten()).item() == pytest.approx(loss, abs=1e-5)
        return logits

    assert train_lines(run_dir)[0]["loss"] == pytest.approx(first_batch_loss(tokens, own_loss), abs=1e-4)
    trained = load_weights(run_dir / "model.safetensors")
    own = loaded.state_dict()
    assert trained.keys() == own.keys()  # the model's own names
    assert not all(torch.equal(trained[k], own[k]) for k in own)  # and it trained


def test_fsdp_ranks_read_only_their_share(tmp_path):
    import init_shards

    from dtrain.export.weights import save_final_weights

    torch.manual_seed(0)
    weights = tmp_path / "model.safetensors"
    save_final_weights(init_shards.model().state_dict(), weights)
    size = weights.stat().st_size
    ok(torchrun(WORKERS / "init_shards.py", weights, tmp_path))
    for rank in (0, 1):
        facts = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert facts["same"]  # the shards hold the file's tensors
        assert 0.95 * size < facts["whole"]["read"] < 1.1 * size  # the count sees a whole read
        assert 0.45 * size < facts["sharded"]["read"] < 0.6 * size, facts  # each rank reads its half
        assert facts["sharded"]["peak"] < 0.25 * size, facts  # and never holds the model whole


def assert_one_line(result, message: str, run_dir: Path) -> None:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not run_dir.exists()


def test_weights_that_do_not_fit_are_refused_in_one_line(cli, first, tokens, tmp_path):
    weights = first / "model.safetensors"
    # A built-in model: at launch, from the file's header and the model built on the meta device.
    result = cli(*job(tokens, tmp_path / "r", "model.options={n_layer = 3, n_head = 2, n_embd = 16}",
                         "training.max_steps=1", f"model.init_from={weights}"))  # fmt: skip
    message = (
        f"model.init_from = '{weights}' does not fit the model: missing h.2.ln_1.weight, h.2.attn.c_attn.weight, "
        f"h.2.attn.c_proj.weight (and 3 more); shape of wte.weight [257, 32] in the file, [257, 16] in the model, "
    )
    assert_one_line(result, message, tmp_path / "r")
    # A Hugging Face model: in the workers, rank 0 deciding for every rank; said once.
    tiny_hf("gpt2", tmp_path / "hf")
    result = dtrain(*job(tokens, tmp_path / "r", f"model.name=hf-causal-lm:{tmp_path / 'hf'}", "model.options={}",
                         "training.max_steps=1", f"model.init_from={weights}"))  # fmt: skip
    message = (
        # (transformer.wte.weight is not missing: it is tied to lm_head.weight, which the file holds)
        f"model.init_from = '{weights}' does not fit the model: missing transformer.wpe.weight, "
        f"transformer.h.0.ln_1.weight, transformer.h.0.ln_1.bias (and 24 more); unexpected h.0.attn.c_attn.weight, "
    )
    assert_one_line(result, message, tmp_path / "r")
    # Integers where the model holds floats (a file of token ids, a quantized export): never cast and trained.
    ints = tmp_path / "ints.safetensors"
    save_file({name: t.to(torch.int32) for name, t in load_weights(weights).items()}, ints)
    result = cli(*job(tokens, tmp_path / "r", OPTIONS, "training.max_steps=1", f"model.init_from={ints}"))
    message = f"model.init_from = '{ints}' holds wte.weight as I32 and the model's is floating point"
    assert_one_line(result, message, tmp_path / "r")


@pytest.mark.parametrize(
    "setting, message",
    [
        ("model.init_from={tmp}/nothing", "model.init_from = '{tmp}/nothing' does not exist"),
        ("model.init_from={tokens}/meta.json", "model.init_from = '{tokens}/meta.json' is not a safetensors file"),
        ("model.name=hf:{tmp}", "model.name = 'hf:{tmp}': {tmp} holds no config.json"),
        ("model.name=hf:{tmp}/nothing", "model.name = 'hf:{tmp}/nothing': {tmp}/nothing is not a folder"),
        ("model.name=hf:{tmp}/small", "model.name = 'hf:{tmp}/small' has a vocabulary of 100 tokens and the data's"),
        ("model.name=hf:{tmp}/config", "model.name = 'hf:{tmp}/config': {tmp}/config holds no model.safetensors"),
        (
            "model.init_from={weights} run.overwrite=true",  # run.dir: the first run's own
            "model.init_from = '{weights}' is inside run.dir, whose outputs run.overwrite=true deletes",
        ),
    ],
)
def test_paths_that_hold_no_weights_are_refused_at_launch(cli, first, tokens, tmp_path, setting, message):
    fill = {"tmp": tmp_path, "tokens": tokens, "weights": first / "model.safetensors"}
    for folder in ("small", "config"):  # config.json alone, or with its weights
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 100}))
    save_file({"wte.weight": torch.zeros(100, 8)}, tmp_path / "small" / "model.safetensors")
    run_dir = first if "overwrite" in setting else tmp_path / "r"
    result = cli(*job(tokens, run_dir, OPTIONS, *setting.format(**fill).split()))
    assert_one_line(result, message.format(**fill), tmp_path / "r")
    assert (first / "model.safetensors").is_file()


def test_a_hugging_face_folder_given_to_the_built_in_gpt_names_the_setting_that_takes_it(first, tmp_path):
    """A Hugging Face folder the built-in gpt cannot take (here its own GPT-2 export, read back by a gpt of
    another depth) is refused with the setting that trains that folder's model: model.name = 'hf:FOLDER'."""
    pytest.importorskip("transformers")
    from dtrain.export.hf import export_hf

    folder = export_hf(first, tmp_path / "hf")
    with torch.device("meta"):
        model = GPT(vocab_size=257, block_size=BLOCK, n_layer=3, n_head=2, n_embd=32)
    with pytest.raises(ConfigError) as error:
        init_from.check_fit(model, init_from.resolve("model.init_from", str(folder)))
    assert str(error.value).endswith(
        f"— {folder} is a Hugging Face model folder: to train its model, give model.name = 'hf:{folder}'"
    )
