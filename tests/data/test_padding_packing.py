"""Dynamic padding (data.padding = longest, dtrain.pad_to_longest) and sequence packing (data.packing):
what the collator makes of given rows, that padding and packing leave every loss what it is without them,
that tokens/s counts real tokens only, and a 2-process run on padded rows (tests/workers/padded_rows.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import dtrain
from dtrain.config import Config
from dtrain.data import padding
from dtrain.data.batch import IGNORE_INDEX, real_tokens
from dtrain.data.packing import PackedWindows, mark_documents
from dtrain.data.prepare import prepare_text
from dtrain.errors import DataError
from dtrain.models.gpt import GPT
from dtrain.train.loss import LossOf
from helpers import WORKERS, ok, train_lines
from helpers import dtrain as dtrain_cli

EOT = 9  # the documents' separator in the hand-made windows


def test_the_collator_pads_to_the_longest_row_rounded_to_the_multiple():
    rows = [
        {"input_ids": [5, 6, 7], "label": 1},
        {"input_ids": torch.tensor([8, 9, 10, 11, 12]), "label": 0},
        {"input_ids": [13, 14], "label": 1},
    ]
    batch = dtrain.pad_to_longest(pad_token_id=3, multiple_of=4)(rows)
    assert batch["input_ids"].tolist() == [
        [5, 6, 7, 3, 3, 3, 3, 3],
        [8, 9, 10, 11, 12, 3, 3, 3],
        [13, 14, 3, 3, 3, 3, 3, 3],
    ]
    assert batch["attention_mask"].tolist() == [[1] * 3 + [0] * 5, [1] * 5 + [0] * 3, [1] * 2 + [0] * 6]
    assert batch["label"].tolist() == [1, 0, 1]  # a per-row field is stacked, and no LM labels are made
    assert "labels" not in batch
    lm = dtrain.pad_to_longest(pad_token_id=3)([{"input_ids": [5, 6, 7]}, {"input_ids": [8]}])
    assert lm["input_ids"].tolist() == [[5, 6, 7], [8, 3, 3]]
    assert lm["labels"].tolist() == [[5, 6, 7], [8, IGNORE_INDEX, IGNORE_INDEX]]  # a causal LM's own labels
    given = dtrain.pad_to_longest(pad_token_id=0)(
        [{"input_ids": [5, 6], "attention_mask": [0, 1], "labels": [-100, 6]}, {"input_ids": [7, 8, 9]}][:1]
        + [{"input_ids": [7, 8, 9], "attention_mask": [1, 1, 1], "labels": [7, 8, 9]}]
    )
    assert given["attention_mask"].tolist() == [[0, 1, 0], [1, 1, 1]]  # the rows' own masks, padded with 0
    assert given["labels"].tolist() == [[IGNORE_INDEX, 6, IGNORE_INDEX], [7, 8, 9]]


def test_rows_the_collator_cannot_line_up_are_one_line():
    collate = dtrain.pad_to_longest(pad_token_id=0)
    for rows, says in [
        ([{"input_ids": [1, 2], "labels": [5]}], "row 0's 'labels' has 1 entries for 2 input_ids"),
        ([{"input_ids": [1], "attention_mask": [1]}, {"input_ids": [1, 2], "attention_mask": [1]}], "row 1's 'at"),
        ([], "an empty batch"),
    ]:
        with pytest.raises(DataError, match=says) as caught:
            collate(rows)
        assert "\n" not in str(caught.value)


def test_the_pad_token_comes_from_the_tokenizer_or_the_model_config_else_one_line():
    class Tokenizer:
        pad_token_id = 50256

    assert dtrain.pad_to_longest(tokenizer=Tokenizer()).pad_token_id == 50256
    with pytest.raises(dtrain.ConfigError, match="pad token id") as caught:
        dtrain.pad_to_longest(tokenizer=object())
    assert "\n" not in str(caught.value)
    data = Config().data
    data.padding = "longest"

    class Masked(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None, labels=None):
            return input_ids

    class HasConfig(Masked):
        config = type("C", (), {"pad_token_id": 2})()

    assert padding.from_config(data, HasConfig()).pad_token_id == 2
    with pytest.raises(dtrain.ConfigError, match="data.pad_token_id"):
        padding.from_config(data, Masked())
    data.pad_token_id = 4
    assert padding.from_config(data, Masked()).pad_token_id == 4
    # The built-in GPT takes (inputs, target) batches, not the collator's dicts: said before any step.
    with pytest.raises(dtrain.ConfigError, match="GPT.forward takes no attention_mask"):
        padding.from_config(data, GPT(64, block_size=16, n_layer=1, n_head=2, n_embd=16))


def _varied_rows() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, 64, (n,), generator=g).tolist() for n in (5, 16, 2, 11)]


def test_a_padded_batch_gives_the_loss_of_its_samples_one_by_one():
    """Hugging Face GPT-2 (attention mask, -100 labels) and the built-in GPT ((inputs, target) with -100
    targets): the padded batch's loss is the token-weighted mean of each row's loss alone."""
    pytest.importorskip("transformers")
    from hf_gpt2 import tiny_gpt2

    rows = _varied_rows()
    hf = tiny_gpt2().eval()
    loss_of = LossOf()
    batch = dtrain.pad_to_longest(pad_token_id=0, multiple_of=8)([{"input_ids": r} for r in rows])
    assert batch["input_ids"].shape[1] == 16
    padded = loss_of(hf, batch)[0]
    alone = [hf(input_ids=torch.tensor([r]), labels=torch.tensor([r])).loss for r in rows]
    weights = torch.tensor([len(r) - 1 for r in rows], dtype=torch.float)  # targets after GPT-2's shift
    assert padded.item() == pytest.approx((torch.stack(alone) * weights).sum().item() / weights.sum().item(), abs=1e-5)

    torch.manual_seed(0)
    gpt = GPT(64, block_size=16, n_layer=2, n_head=2, n_embd=16).eval()
    x = batch["input_ids"][:, :-1]
    y = batch["labels"][:, 1:]  # the next tokens, -100 on padding
    padded = loss_of(gpt, (x, y))[0]
    sums = [F.cross_entropy(gpt(torch.tensor([r[:-1]]))[0], torch.tensor(r[1:]), reduction="sum") for r in rows]
    assert padded.item() == pytest.approx(torch.stack(sums).sum().item() / weights.sum().item(), abs=1e-5)


def _documents() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(10, 64, (n,), generator=g).tolist() + [EOT] for n in (4, 7, 2, 9)]


def test_documents_are_marked_in_a_packed_window():
    window = torch.tensor([[1, 2, EOT, 3, 4, 5, EOT, 6, EOT]])
    inputs, target = mark_documents(window[:, :-1], window[:, 1:], EOT)
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    # The target after each end-of-text (the next document's first token) is left out; the EOT is learnt.
    assert target.tolist() == [[2, EOT, IGNORE_INDEX, 4, 5, EOT, IGNORE_INDEX, EOT]]


def test_each_document_of_a_packed_window_has_the_loss_it_has_alone():
    """The built-in GPT: summed over a document's targets, the packed window's token losses equal the
    document's alone — no attention, position or prediction crosses a boundary."""
    torch.manual_seed(0)
    gpt = GPT(64, block_size=32, n_layer=2, n_head=2, n_embd=16).eval()
    docs = _documents()
    stream = torch.tensor([[t for doc in docs for t in doc]])
    inputs, target = mark_documents(stream[:, :-1], stream[:, 1:], EOT)
    logits = gpt(**inputs)
    token_losses = F.cross_entropy(logits[0], target[0], reduction="none", ignore_index=IGNORE_INDEX)
    start = 0
    for doc in docs:
        alone = gpt(torch.tensor([doc[:-1]]))[0]
        expected = F.cross_entropy(alone, torch.tensor(doc[1:]), reduction="sum")
        packed = token_losses[start : start + len(doc) - 1].sum()
        assert packed.item() == pytest.approx(expected.item(), abs=1e-4)
        start += len(doc)


def test_a_hugging_face_model_reads_the_documents_from_the_position_ids():
    """transformers' own mask building finds packed documents in position_ids (eager and sdpa
    attention; flash-attention from the same ids) when the model keeps no cache: GPT-2's packed losses
    per document equal its own; a Trainer given such a model with use_cache on refuses it in one line."""
    pytest.importorskip("transformers")
    from hf_gpt2 import tiny_gpt2

    hf = tiny_gpt2().eval()
    hf.config.use_cache = False  # with a cache to fill, transformers does not look for documents
    docs = [d for d in _documents() if len(d) <= 8]  # within GPT-2's 16 positions
    stream = torch.tensor([[t for doc in docs for t in doc]])
    inputs, target = mark_documents(stream[:, :-1], stream[:, 1:], EOT)
    logits = hf(**inputs).logits
    token_losses = F.cross_entropy(logits[0], target[0], reduction="none")
    start = 0
    for doc in docs:
        alone = hf(input_ids=torch.tensor([doc[:-1]])).logits[0]
        expected = F.cross_entropy(alone, torch.tensor(doc[1:]), reduction="sum")
        assert token_losses[start : start + len(doc) - 1].sum().item() == pytest.approx(expected.item(), abs=1e-4)
        start += len(doc)


@pytest.fixture(scope="module")
def token_folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("packing")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(24):  # short documents: many boundaries in every window
        (corpus / f"doc{i:02}.txt").write_text("abcdefghij"[: 3 + i % 7] * (1 + i % 3))
    prepare_text([str(corpus)], str(root / "tokens"), tokenizer="bytes", val_fraction=0)
    return root / "tokens"


def test_packed_windows_count_every_token_and_a_run_logs_them(token_folder, tmp_path):
    """A packed window is all real tokens (no padding; a document's first token is real though not
    predicted): tokens/s over samples/s is block_size in a real run's log, not its predicted targets."""
    windows = PackedWindows(token_folder, "train", 32)
    batch = windows.take(torch.arange(4))
    assert batch[1].eq(IGNORE_INDEX).sum() > 4  # boundaries inside the windows
    assert real_tokens(batch).item() == 4 * 32
    run = tmp_path / "run"
    ok(
        dtrain_cli(
            "run",
            "examples/gpt_stdlib.toml",
            f"run.dir={run}",
            f"data.path={token_folder}",
            "data.packing=true",
            "data.block_size=32",
            "data.batch_size=4",
            "model.options={n_layer = 1, n_head = 2, n_embd = 16}",
            "training.epochs=10",
            "training.max_steps=3",
            "training.log_every=1",
            "checkpoint.every_steps=0",
            "scheduler.warmup_steps=0",
            "monitor.trackers=[]",
        )
    )
    lines = train_lines(run)
    assert len(lines) == 3
    for line in lines:
        assert line["tokens_per_s"] / line["samples_per_s"] == pytest.approx(32, rel=1e-6)


def test_padded_rows_train_on_two_processes_counting_real_tokens(tmp_path):
    """A datasets.Dataset of rows of 3 to 16 tokens, data.padding = longest (pad to a multiple of 4), on 2
    processes: the loss falls, and every step's tokens/s over samples/s is its rows' real tokens over its
    8 rows (rank r has rows r, r + 2, ...: data.shuffle = false), not the padded width."""
    pytest.importorskip("datasets")
    ok(
        dtrain_cli(
            "launch", "--nproc", "2", str(WORKERS / "padded_rows.py"), str(tmp_path), "data.pad_to_multiple_of=4"
        )
    )
    lines = train_lines(tmp_path / "run")
    lengths = json.loads((tmp_path / "lengths.json").read_text())
    assert len(lines) == 16
    curve = [line["loss"] for line in lines]
    assert sum(curve[-3:]) < sum(curve[:3]) * 0.8, curve
    for step, line in enumerate(lines):
        rows = [(8 * step + i) % len(lengths) for i in range(8)]
        expected = sum(lengths[r] for r in rows) / 8
        assert line["tokens_per_s"] / line["samples_per_s"] == pytest.approx(expected, rel=1e-6), step


def test_packing_refuses_a_model_that_would_attend_across_documents(token_folder):
    pytest.importorskip("transformers")
    from hf_gpt2 import tiny_gpt2

    config = dtrain.load_config(None, ["data.name=tokens", f"data.path={token_folder}", "data.packing=true"])
    with pytest.raises(dtrain.ConfigError, match=r"use_cache = false"):
        dtrain.Trainer(config, model=tiny_gpt2(), train_data=PackedWindows(token_folder, "train", 16))
