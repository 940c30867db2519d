"""LoRA fine-tuning (`training.lora`) on 2 real processes through the real launcher: the base frozen, only the
adapters in the optimizer and the checkpoint files; DDP and FSDP2 take the same steps; a stopped run resumes
bitwise; the whole offline path — a local base model, LoRA, the merged export, `from_pretrained` — and the
adapter folder PeftModel loads.

The runs are shared by the tests (module fixtures): each test reads the files they left."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dtrain.checkpoint.metadata import SafeReader
from dtrain.commands.export import export
from dtrain.export.weights import load_weights, save_final_weights
from dtrain.models.gpt import GPT
from helpers import dtrain, gpt_on_tokens, ok, train_lines

BATCH, BLOCK, VOCAB = 4, 32, 257
GPT_OPTIONS = {"n_layer": 2, "n_head": 2, "n_embd": 32}
OPTIONS = "model.options={n_layer = 2, n_head = 2, n_embd = 32}"
LORA = "training.lora={r = 4, alpha = 8, dropout = 0.1}"  # dropout: its RNG must come back on resume


def job(tokens: Path, run_dir: Path, *args: str) -> list[str]:
    return gpt_on_tokens(
        tokens, run_dir, "training.max_steps=6", "optimizer.lr=0.01", "scheduler.warmup_steps=0", *args
    )


@pytest.fixture(scope="module")
def tokens(json_byte_tokens):
    return json_byte_tokens


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A local base model: the built-in GPT's weights in a file (what a pretraining run leaves)."""
    torch.manual_seed(7)
    path = tmp_path_factory.mktemp("base") / "model.safetensors"
    save_final_weights(GPT(VOCAB, BLOCK, **GPT_OPTIONS).state_dict(), path)
    return path


@pytest.fixture(scope="module")
def gpt_runs(warm, tokens, base, tmp_path_factory) -> dict[str, Path]:
    """The same LoRA fine-tuning of the base, unbroken under DDP and FSDP2, and under DDP stopped at step 3
    (its checkpoint), then rerun to its end."""
    root = tmp_path_factory.mktemp("lora")
    runs = {name: root / name for name in ("ddp", "fsdp", "stopped")}
    common = (OPTIONS, LORA, f"model.init_from={base}", "checkpoint.every_steps=3")
    ok(warm(*job(tokens, runs["ddp"], *common)))
    ok(warm(*job(tokens, runs["fsdp"], *common, "parallel.strategy=fsdp")))
    ok(warm(*job(tokens, runs["stopped"], *common, "training.stop_at_step=3")))
    runs["resumed"] = runs["stopped"]
    (root / "stopped-losses.json").write_text(json.dumps([m["loss"] for m in train_lines(runs["stopped"])]))
    ok(warm(*job(tokens, runs["stopped"], *common)))
    return runs


def adapter_names(names) -> bool:
    return all(".lora_A." in n or ".lora_B." in n for n in names)


def test_only_the_adapters_are_in_the_optimizer_and_the_checkpoint_files(gpt_runs, base):
    for name in ("ddp", "fsdp"):
        step = gpt_runs[name] / "checkpoints" / "step-6"
        stored = SafeReader(step / "state").read_metadata().state_dict_metadata
        model = [k[len("model.") :] for k in stored if k.startswith("model.")]
        prefix = "optimizer.state."
        optimizer = {k[len(prefix) :].rsplit(".", 1)[0] for k in stored if k.startswith(prefix)}
        assert model and adapter_names(model), model
        assert optimizer and adapter_names(optimizer), optimizer
        # 2 layers × (c_attn, attn.c_proj, c_fc, mlp.c_proj) × (A, B): no base tensor anywhere.
        assert len(model) == 16 and len(optimizer) == 16
        trainer = json.loads((step / "trainer.json").read_text())
        assert trainer["identity"]["lora base"] == f"model.init_from = {base}"  # the base, by reference
        assert adapter_names(trainer["optimizer"]["state"]) or not trainer["optimizer"]["state"]
        with safe_open(str(gpt_runs[name] / "model.safetensors"), "pt") as final:
            assert adapter_names(final.keys()) and len(list(final.keys())) == 16
        said = json.loads((gpt_runs[name] / "model.json").read_text())["lora"]
        assert said["settings"]["target_modules"] == ["c_attn", "c_proj", "c_fc"] and said["settings"]["r"] == 4
    losses = [m["loss"] for m in train_lines(gpt_runs["ddp"])]
    assert losses[-1] < losses[0]  # the adapters learn


def test_ddp_and_fsdp_take_the_same_steps(gpt_runs):
    ddp, fsdp = train_lines(gpt_runs["ddp"]), train_lines(gpt_runs["fsdp"])
    assert [m["step"] for m in ddp] == [m["step"] for m in fsdp] == list(range(1, 7))
    for a, b in zip(ddp, fsdp):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a, b)
    one, other = (
        load_weights(gpt_runs["ddp"] / "model.safetensors"),
        load_weights(gpt_runs["fsdp"] / "model.safetensors"),
    )
    assert one.keys() == other.keys()
    for name, tensor in one.items():
        torch.testing.assert_close(other[name], tensor, atol=1e-5, rtol=1e-5)


def test_a_stopped_run_resumes_bitwise(gpt_runs):
    whole, resumed = train_lines(gpt_runs["ddp"]), train_lines(gpt_runs["resumed"])
    before = json.loads((gpt_runs["stopped"].parent / "stopped-losses.json").read_text())
    assert len(before) == 3  # it stopped at step 3 and really resumed from there
    assert [(m["step"], m["loss"]) for m in resumed] == [(m["step"], m["loss"]) for m in whole]
    one, other = (
        load_weights(gpt_runs["ddp"] / "model.safetensors"),
        load_weights(gpt_runs["resumed"] / "model.safetensors"),
    )
    for name, tensor in one.items():
        assert torch.equal(other[name], tensor), name


def trained_gpt(base: Path, run_dir: Path) -> torch.nn.Module:
    """The model the run trained, rebuilt as a resume rebuilds it: the base from its file, the adapters in."""
    from dtrain.models import lora

    model = GPT(VOCAB, BLOCK, **GPT_OPTIONS)
    model.load_state_dict(load_weights(base))
    settings = json.loads((run_dir / "model.json").read_text())["lora"]["settings"]
    lora.inject(model, lora.Lora(settings, "test"))
    adapters = load_weights(run_dir / "model.safetensors")
    assert not model.load_state_dict(adapters, strict=False).unexpected_keys
    return model.eval()


def test_the_offline_path_ends_in_a_merged_folder_from_pretrained_loads(gpt_runs, base, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir = gpt_runs["ddp"]
    ids = torch.randint(0, VOCAB, (2, BLOCK), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = trained_gpt(base, run_dir)(ids)
    assert expected.shape == (2, BLOCK, VOCAB)
    # The adapter folder, onto the base model, with peft's own loader.
    said = ok(dtrain("export", str(run_dir), "--format", "hf", "--out", str(tmp_path / "adapter"))).stdout
    assert "PeftModel.from_pretrained" in said
    assert {p.name for p in (tmp_path / "adapter").iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    plain = GPT(VOCAB, BLOCK, **GPT_OPTIONS)
    plain.load_state_dict(load_weights(base))
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(plain, tmp_path / "adapter").eval()(ids)
    torch.testing.assert_close(adapted, expected, atol=1e-5, rtol=1e-5)
    # Merged into the base: a GPT-2 folder transformers loads, with the trained model's logits.
    export(str(run_dir), "hf", str(tmp_path / "merged"), None, "", merged=True)  # the command's own function
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)
    # A checkpoint's adapters export alike.
    export(str(run_dir), "hf", str(tmp_path / "step-3"), 3, "")
    with safe_open(str(tmp_path / "step-3" / "adapter_model.safetensors"), "pt") as file:
        names = list(file.keys())
    assert len(names) == 16 and all(n.startswith("base_model.model.h.") and ".default." not in n for n in names)


def test_bad_lora_settings_are_one_line(tmp_path):
    from helpers import SMALL_JOB

    for lora, says in [
        ("{r = 0}", "training.lora.r = 0 must be a whole number > 0"),
        ("{r = 2, rank = 4}", "training.lora.rank is not a LoRA setting"),
        ("{r = 2}", "dtrain has no default target_modules for a Sequential"),
        ("{r = 2, target_modules = ['c_attn']}", "training.lora.target_modules = ['c_attn'] cannot adapt this"),
    ]:
        args = ("run", *SMALL_JOB, f"training.lora={lora}", "--nproc", "1", f"run.dir={tmp_path / 'run'}")
        result = dtrain(*args)
        assert result.returncode == 2, (lora, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and says in lines[0], (lora, result.stderr)


def test_a_hugging_face_model_under_fsdp_exports_adapters_and_merged_weights(warm, tokens, tmp_path):
    """A transformers GPT-2 from a local folder (its Conv1D layers: peft's fan_in_fan_out), LoRA on peft's own
    default target for gpt2, sharded by FSDP2: both exports load, with the same logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(3)
    config = GPT2Config(vocab_size=VOCAB, n_positions=2 * BLOCK, n_embd=32, n_layer=2, n_head=2)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "base")
    run_dir = tmp_path / "run"
    no_dropout = "model.options={resid_pdrop = 0.0, embd_pdrop = 0.0, attn_pdrop = 0.0}"
    ok(warm(*job(tokens, run_dir, f"model.name=hf-causal-lm:{tmp_path / 'base'}", no_dropout,
                   "training.lora={r = 2}", "parallel.strategy=fsdp")))  # fmt: skip
    with safe_open(str(run_dir / "model.safetensors"), "pt") as final:
        assert sorted({n.split(".")[-4] for n in final.keys()}) == ["c_attn"]  # noqa: SIM118 — peft: gpt2
        assert adapter_names(final.keys())
    export(str(run_dir), "hf", None, None, "")
    export(str(run_dir), "hf", str(tmp_path / "merged"), None, "", merged=True)
    ids = torch.randint(0, VOCAB, (2, BLOCK), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
        before = base(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(base, run_dir / "hf").eval()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(input_ids=ids).logits
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(adapted, before, atol=1e-4)  # the adapters trained and moved the logits


def test_a_transformers_model_handed_to_the_trainer_trains_only_its_adapters(tmp_path):
    """In code, one process: a Llama given to `dtrain.Trainer` with dict batches (its own `.loss`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import dtrain

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    model = LlamaForCausalLM(config)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(0))
    job = dtrain.Config.from_dict({
        "run": {"dir": str(tmp_path / "run")},
        "data": {"batch_size": 8},
        "optimizer": {"lr": 0.01},
        "training": {"epochs": 2, "log_every": 1, "lora": {"r": 2}},
        "monitor": {"trackers": []},
    })  # fmt: skip
    trainer = dtrain.Trainer(job, model=model, train_data={"input_ids": ids, "labels": ids})
    trainer.fit()
    assert trainer.optimizer is not None
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    in_optimizer = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert trained and adapter_names(trained)
    assert in_optimizer == {id(p) for name, p in model.named_parameters() if name in trained}
    assert {n.split(".")[-4] for n in trained} == {"q_proj", "v_proj"}  # peft's default for llama
    for name, p in model.named_parameters():
        original = before.get(name.replace(".base_layer.", "."))
        if original is not None:
            assert torch.equal(p.detach(), original), name  # the base never moved
    assert any(
        not torch.equal(p.detach()[0], p.detach()[0] * 0) for n, p in model.named_parameters() if ".lora_B." in n
    )
    said = json.loads((tmp_path / "run" / "model.json").read_text())
    assert said["architecture"] == "LlamaForCausalLM"
    assert said["lora"]["base"] == "its own initial weights (LlamaForCausalLM, run.seed 0)"


def test_eval_and_generate_of_a_lora_run_say_in_one_line_what_works_instead(gpt_runs):
    """Neither command rebuilds base + adapters yet: each says so in one line and names the merged export,
    instead of a state-dict traceback listing every missing base tensor."""
    run_dir = gpt_runs["ddp"]
    for args in (("eval", str(run_dir)), ("generate", str(run_dir), "--prompt", "def")):
        result = dtrain(*args)
        lines = (result.stdout + result.stderr).strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, (args, result.stderr)
        assert "trained LoRA adapters (training.lora)" in lines[0] and "--merged" in lines[0], lines[0]
