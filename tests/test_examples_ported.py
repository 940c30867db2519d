"""The ported examples under examples/ — Accelerate's nlp_example.py and its by_feature checkpointing and
gradient accumulation, transformers' run_clm_no_trainer.py — run as their users run them: `dtrain launch
--nproc 2` on CPU processes, with a tiny model and tokenizer built here and saved to a folder, and local data
(nothing downloaded). Each learns, writes its metrics, and checkpoints and resumes as dtrain promises."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
import torch

from helpers import ROOT, dtrain, eval_lines, ok, train_lines, weights

datasets = pytest.importorskip("datasets")  # the test extra installs them
transformers = pytest.importorskip("transformers")

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def launch(script: str, *args: str, cache: Path):
    """`dtrain launch --nproc 2 examples/SCRIPT ARGS`, offline, with datasets' cache in the test's folder."""
    extra = {**OFFLINE, "HF_DATASETS_CACHE": str(cache), "HF_HOME": str(cache / "hf")}
    return ok(dtrain("launch", "--nproc", "2", f"examples/{script}", *map(str, args), extra_env=extra))


def falls(run_dir: Path) -> list[float]:
    losses = [m["loss"] for m in train_lines(run_dir)]
    assert len(losses) >= 6 and sum(losses[-3:]) < sum(losses[:3]) - 0.05, losses
    return losses


# --- Accelerate: nlp_example.py, by_feature/checkpointing.py and gradient_accumulation.py ----------------------

# The pairs of one class draw their words from the first list, those of the other from the second.
WORDS_A = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
WORDS_B = ["lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon"]


def mrpc_like(n: int, seed: int, flipped: int = 0) -> dict[str, list]:
    """Sentence pairs with MRPC's columns; the label is which word list the pair was drawn from (learnable),
    but for every `flipped`-th pair, whose label is the other one (so that no model scores them all)."""
    g = torch.Generator().manual_seed(seed)
    rows: dict[str, list] = {"sentence1": [], "sentence2": [], "label": [], "idx": []}
    for i in range(n):
        label = int(torch.randint(0, 2, (1,), generator=g))
        words = WORDS_A if label else WORDS_B
        pick = [words[int(j)] for j in torch.randint(0, len(words), (12,), generator=g)]
        cut, end = 3 + int(torch.randint(0, 4, (1,), generator=g)), 7 + int(torch.randint(0, 5, (1,), generator=g))
        rows["sentence1"].append(" ".join(pick[:cut]))
        rows["sentence2"].append(" ".join(pick[cut:end]))  # lengths vary: the collate_fn pads
        rows["label"].append(1 - label if flipped and i % flipped == flipped - 1 else label)
        rows["idx"].append(i)
    return rows


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """A tiny BERT for sequence classification with its WordPiece tokenizer, saved as the hub would give
    them, and an MRPC-shaped DatasetDict saved to disk (the validation split, 21 pairs, does not divide by 2)."""
    root = tmp_path_factory.mktemp("bert")
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS_A, *WORDS_B])}
    transformers.BertTokenizer(vocab=vocab).save_pretrained(root / "model")
    torch.manual_seed(0)
    size = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}
    config = transformers.BertConfig(vocab_size=len(vocab), max_position_embeddings=64, **size)
    transformers.BertForSequenceClassification(config).save_pretrained(root / "model")
    splits = {"train": mrpc_like(64, 1), "validation": mrpc_like(21, 2, flipped=4)}
    datasets.DatasetDict({k: datasets.Dataset.from_dict(v) for k, v in splits.items()}).save_to_disk(root / "glue")
    return root


# 64 pairs, 4 a micro-batch, 2 micro-batches a step, 2 processes: 4 steps an epoch, 12 in 3 epochs.
NLP_PLAN = ["data.batch_size=4", "training.epochs=3", "optimizer.lr=0.01", "scheduler.warmup_steps=2"]
NLP_PLAN += ["training.log_every=1"]


@pytest.fixture(scope="module")
def nlp_run(bert, tmp_path_factory):
    """nlp_example.py with checkpointing.py's `--checkpointing_steps 5` and gradient_accumulation.py's
    `--gradient_accumulation_steps 2`, as the config keys they are."""
    run_dir = tmp_path_factory.mktemp("nlp") / "run"
    model, data = bert / "model", bert / "glue"
    extra = ["checkpoint.every_steps=5", "training.grad_accum_steps=2"]
    launch("accelerate_nlp_example.py", "--model", model, "--data", data, "--run-dir", run_dir, *NLP_PLAN, *extra,
           cache=run_dir.parent / "cache")  # fmt: skip
    return run_dir


def test_accelerate_nlp_example_learns_and_scores_accuracy_and_f1_over_the_whole_split(bert, nlp_run):
    """The loss falls; every epoch's eval record holds GLUE MRPC's accuracy and F1, and the last one equals
    scikit-learn's on the final model's predictions of all 21 validation pairs (each once, none padded)."""
    falls(nlp_run)
    assert [m["step"] for m in train_lines(nlp_run)] == list(range(1, 13))
    evals = eval_lines(nlp_run)
    assert [m["step"] for m in evals] == [4, 8, 12]  # after each epoch
    assert (
        all({"eval_accuracy", "eval_f1", "train_loss"} <= m.keys() for m in evals) and evals[-1]["eval_samples"] == 21
    )
    from sklearn.metrics import accuracy_score, f1_score

    import dtrain

    tokenizer = transformers.AutoTokenizer.from_pretrained(bert / "model")
    model = transformers.AutoModelForSequenceClassification.from_pretrained(bert / "model")
    model.load_state_dict(dtrain.load_weights(nlp_run / "model.safetensors"))
    pairs = datasets.load_from_disk(bert / "glue")["validation"]
    batch = tokenizer(list(pairs["sentence1"]), list(pairs["sentence2"]), padding="longest", return_tensors="pt")
    with torch.no_grad():
        predicted = model.eval()(**batch).logits.argmax(-1)
    assert 0 < evals[-1]["eval_f1"] < 1 and 0 < evals[-1]["eval_accuracy"] < 1  # the flipped pairs are missed
    assert evals[-1]["eval_f1"] == pytest.approx(f1_score(list(pairs["label"]), predicted), abs=1e-12)
    assert evals[-1]["eval_accuracy"] == pytest.approx(accuracy_score(list(pairs["label"]), predicted), abs=1e-12)


def test_accelerate_by_feature_resumes_from_a_chosen_checkpoint_exactly(bert, nlp_run, tmp_path):
    """checkpointing.py's `--resume_from_checkpoint step_5` of that run into a new run.dir (with `--checkpointing_steps
    epoch`): it continues at step 6 and ends bitwise where the uninterrupted run ended."""
    assert sorted(p.name for p in (nlp_run / "checkpoints").glob("step-*")) == ["step-10", "step-12", "step-5"]
    run_dir = tmp_path / "more"
    resumed = launch(
        "accelerate_by_feature.py",
        *("--model", bert / "model", "--data", bert / "glue", "--run-dir", run_dir),
        *("--resume_from_checkpoint", nlp_run / "checkpoints" / "step-5"),
        *("--gradient_accumulation_steps", "2", "--checkpointing_steps", "epoch"),
        *NLP_PLAN,
        cache=tmp_path / "cache",
    )
    assert re.search(r"^resumed from \S+/step-5 \(step 5 of 12", resumed.stderr, re.M), resumed.stderr
    assert [m["step"] for m in train_lines(run_dir)] == list(range(6, 13))
    assert [m["loss"] for m in train_lines(run_dir)] == [m["loss"] for m in train_lines(nlp_run)][5:]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == ["step-12", "step-8"]  # each epoch
    a, b = weights(nlp_run), weights(run_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- transformers: run_clm_no_trainer.py -----------------------------------------------------------------------

SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "her sister", "the teacher"]
VERBS = ["sat on", "looked at", "walked to", "painted", "found", "liked"]
THINGS = ["the mat", "a red door", "the garden", "his book", "the river", "a small house"]


def sentences(n: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    pick = lambda words: words[int(torch.randint(0, len(words), (1,), generator=g))]  # noqa: E731
    return [f"{pick(SUBJECTS)} {pick(VERBS)} {pick(THINGS)}." for _ in range(n)]


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A tiny GPT-2 with a byte-level BPE tokenizer trained here on the text, and train / validation .txt files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("gpt2")
    (root / "train.txt").write_text("\n".join(sentences(240, 1)) + "\n")
    (root / "validation.txt").write_text("\n".join(sentences(40, 2)) + "\n")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet)
    bpe.train([str(root / "train.txt")], trainer)
    end = "<|endoftext|>"
    tokenizer = transformers.GPT2TokenizerFast(tokenizer_object=bpe, eos_token=end, bos_token=end, unk_token=end)
    tokenizer.save_pretrained(root / "model")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(root / "model")
    return root


def test_run_clm_fine_tunes_stops_resumes_and_exports_the_model_with_its_tokenizer(gpt2, tmp_path):
    """Blocks of 32 tokens from local text files; stopped after step 3 (training.stop_at_step), the same
    command again resumes there and finishes; the loss falls over the whole run; every epoch's eval_loss is
    the mean over the validation tokens (the exported model, scored here, agrees) and eval_perplexity its
    exp; run.dir/hf holds the model and tokenizer for from_pretrained."""
    run_dir = tmp_path / "run"
    command = ["--model", gpt2 / "model", "--train-file", gpt2 / "train.txt"]
    command += ["--validation-file", gpt2 / "validation.txt", "--block-size", "32", "--run-dir", run_dir]
    command += ["data.batch_size=4", "training.epochs=2", "optimizer.lr=0.003", "training.log_every=1"]
    command += ["scheduler.warmup_steps=2"]
    launch("run_clm.py", *command, "training.stop_at_step=3", cache=tmp_path / "cache")
    assert [m["step"] for m in train_lines(run_dir)] == [1, 2, 3] and not (run_dir / "hf").exists()
    resumed = launch("run_clm.py", *command, cache=tmp_path / "cache")
    assert re.search(r"^resumed from \S+/step-3 \(step 3 of (\d+)", resumed.stderr, re.M), resumed.stderr
    steps = [m["step"] for m in train_lines(run_dir)]
    per_epoch = steps[-1] // 2
    assert steps == list(range(1, steps[-1] + 1)) and per_epoch > 3
    falls(run_dir)
    evals = eval_lines(run_dir)
    assert [m["step"] for m in evals] == [per_epoch, 2 * per_epoch]
    assert all(m["eval_perplexity"] == pytest.approx(math.exp(m["eval_loss"])) for m in evals)
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]

    # The export: the final model and the tokenizer, as the original's save_pretrained(output_dir) leaves them.
    model = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(run_dir / "hf")
    given = transformers.AutoTokenizer.from_pretrained(gpt2 / "model")
    assert (run_dir / "hf" / "tokenizer.json").is_file()
    assert tokenizer("the old man painted a red door.").input_ids == given("the old man painted a red door.").input_ids
    spec = importlib.util.spec_from_file_location("run_clm", ROOT / "examples" / "run_clm.py")
    run_clm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_clm)
    raw = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": sentences(40, 2)})})
    blocks = torch.tensor(run_clm.blocks(raw, tokenizer, 32)["train"]["input_ids"])
    assert evals[-1]["eval_samples"] == len(blocks)
    with torch.no_grad():
        loss = model(input_ids=blocks, labels=blocks).loss.item()  # every block has 31 targets: the token mean
    assert loss == pytest.approx(evals[-1]["eval_loss"], abs=1e-4)
    assert json.loads((run_dir / "hf" / "config.json").read_text())["model_type"] == "gpt2"
