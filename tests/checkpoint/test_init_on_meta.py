"""Under FSDP, a run started from a file's weights builds its model's parameters on the meta device and
gives memory only to each rank's shards: no rank ever holds the whole model (its peak memory measured
by the kernel, on 2 real processes), and it trains exactly as when every rank built the whole model."""

import json
import sys
from pathlib import Path

import pytest
import torch

import dtrain
from dtrain.export.weights import load_weights, save_final_weights
from dtrain.models.gpt import GPT
from helpers import WORKERS, ok, torchrun, train_lines, weights

sys.path.insert(0, str(Path(__file__).parent))
import test_init_from

tokens = test_init_from.tokens  # the same token data (a fixture)

# About 400 MB of fp32 weights: a whole model on a rank stands far above the noise of a process's memory.
BIG = {"n_layer": 8, "n_head": 8, "n_embd": 1024}


def options(shape: dict) -> str:
    return "model.options={" + ", ".join(f"{k} = {v}" for k, v in shape.items()) + "}"


def test_no_rank_builds_the_whole_model(tokens, tmp_path):
    torch.manual_seed(0)
    file = tmp_path / "model.safetensors"
    save_final_weights(GPT(vocab_size=257, block_size=test_init_from.BLOCK, **BIG).state_dict(), file)
    size = file.stat().st_size
    ok(torchrun(WORKERS / "meta_init.py", "peak", tokens, tmp_path, file, options(BIG)))
    for rank in (0, 1):
        facts = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # The measure sees a whole model built on a rank (what every rank did before)...
        assert facts["whole"] > 0.9 * size, facts
        # ... and the job's own set-up (build, shard, read the file) raises the peak by about its shards.
        assert 0.45 * size < facts["held"] < 0.55 * size, facts
        assert facts["built"] < 0.75 * size, facts


def tied_llama(folder: Path) -> None:
    """A tiny Llama whose head is tied to its embedding (one tensor in the file) and whose rotary
    embedding's `inv_freq` is a buffer computed when built, in no file."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(5)
    LlamaForCausalLM(test_init_from.tiny_llama_config(tied=True)).save_pretrained(folder)


def test_it_trains_exactly_as_when_every_rank_built_the_whole_model(tokens, tmp_path):
    pytest.importorskip("transformers")
    torch.manual_seed(4)
    file = tmp_path / "gpt.safetensors"
    save_final_weights(test_init_from.gpt().state_dict(), file)
    tied_llama(tmp_path / "llama")
    ok(torchrun(WORKERS / "meta_init.py", "losses", tokens, tmp_path, file, tmp_path / "llama",
                test_init_from.OPTIONS))  # fmt: skip
    facts = json.loads((tmp_path / "facts.json").read_text())
    for name in ("gpt", "hf"):
        meta, whole = tmp_path / f"{name}_meta", tmp_path / f"{name}_whole"
        # Built on the meta device (the GPT's run twice: stopped after step 2, resumed), and as before.
        runs = facts[f"{name}_meta"] + facts[f"{name}_whole"]
        assert [run["on_meta"] for run in runs] == [True] * (len(runs) - 1) + [False], facts
        assert all(run["tied"] for run in runs), facts
        losses = [line["loss"] for line in train_lines(meta)]
        assert len(losses) == 3 and losses == [line["loss"] for line in train_lines(whole)]
        assert all(torch.equal(tensor, weights(whole)[key]) for key, tensor in weights(meta).items())
    # And it started from the file's weights: its first loss is theirs.
    began = train_lines(tmp_path / "gpt_meta")[0]["loss"]
    assert began == pytest.approx(test_init_from.gpt_loss(tokens, load_weights(file)), abs=1e-4)


def test_a_model_on_the_meta_device_that_nothing_would_fill_is_refused(tmp_path):
    """Parameters on the meta device get memory only from a sharding strategy, and values only from weights
    to start from: a script's model built so, trained otherwise, is one line, never uninitialised memory."""
    import tiny

    from dtrain.errors import ConfigError
    from dtrain.models.empty import parameters_on_meta
    from dtrain.parallel import deferred

    with parameters_on_meta():
        model = tiny.small_model()
    assert all(p.is_meta for p in model.parameters())
    # One process: nothing shards it.
    trainer = dtrain.Trainer(tiny.small_config(tmp_path / "run"), model=model, train_data=tiny.small_data())
    said = r"^the model's parameters \(0.weight, 0.bias, 2.weight, \.\.\.\) are on the meta device, and only "
    with pytest.raises(ConfigError, match=said + "parallel.strategy = fsdp or hsdp on 2 or more processes"):
        trainer.setup()
    # Sharded, with no weights to fill it.
    with pytest.raises(ConfigError, match="are on the meta device and no weights fill them; give model.init_from"):
        deferred.check(model, sharded=True, weights_given=False)
    deferred.check(model, sharded=True, weights_given=True)  # a file fills it (the loader refuses one that misses any)
