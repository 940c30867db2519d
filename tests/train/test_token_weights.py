"""Accumulation and DDP give one big batch's update for token-mean losses too: four padded sequences of
15, 6, 12 and 23 tokens, one SGD step at lr 1, as batch 2 x accumulation 2 in one process and as batch 2
on each of 2 processes, against the update of one batch of all four computed here by hand."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

from helpers import WORKERS, metrics, ok, run

pytest.importorskip("transformers")
sys.path.insert(0, str(WORKERS))
import token_weights as job  # tests/workers: the script the runs execute


def one_batch_update(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    """The weights after one SGD step at lr 1 on `loss` (tied weights stay tied)."""
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= p.grad
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def expected(name: str) -> dict[str, torch.Tensor]:
    """The update of one batch of all four samples, with the model's own token-mean loss."""
    if name == "hf":
        model = job.hf_model()
        loss = model(**default_collate(job.hf_samples())).loss  # a mean over the shifted real targets
    else:
        model = job.gpt_model()
        inputs, targets = default_collate(job.gpt_samples())
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())  # -100 left out
    return one_batch_update(model, loss)


def relative_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    start = job.hf_model() if "transformer.wte.weight" in a else job.gpt_model()
    moved = sum(((b[k] - start.state_dict()[k]) ** 2).sum() for k in b)
    return float(sum(((a[k] - b[k]) ** 2).sum() for k in b) / moved) ** 0.5


@pytest.fixture(scope="module")
def trained(warm_torchrun, tmp_path_factory):
    """name → (way, weights after the step, its metrics.jsonl)."""
    found = {}
    for way, launch in (
        ("accumulation", lambda out: run([sys.executable, str(WORKERS / "token_weights.py"), str(out), "2"])),
        ("ddp", lambda out: warm_torchrun(WORKERS / "token_weights.py", out, 1)),
    ):
        out = tmp_path_factory.mktemp(way)
        ok(launch(out))
        for name in ("hf", "gpt"):
            found[(way, name)] = (torch.load(out / f"{name}.pt"), metrics(out / name))
    return found


@pytest.mark.parametrize("way", ["accumulation", "ddp"])
@pytest.mark.parametrize("name", ["hf", "gpt"])
def test_one_step_equals_one_batch_of_all_samples_for_a_token_mean_loss(trained, way, name):
    weights, _ = trained[(way, name)]
    reference = expected(name)
    assert relative_distance(weights, reference) < 1e-3  # sample weighting is 28-38 % off here
    for key, value in reference.items():
        torch.testing.assert_close(weights[key], value, atol=1e-6, rtol=0, msg=f"{way} {name}: {key}")


@pytest.mark.parametrize("way", ["accumulation", "ddp"])
def test_tokens_per_s_counts_real_tokens_not_padding(trained, way):
    for name, real in (("hf", sum(job.LENGTHS)), ("gpt", sum(n - 1 for n in job.LENGTHS))):
        line = next(r for r in trained[(way, name)][1] if "tokens_per_s" in r)
        # One window, one clock: tokens over samples is the real tokens per sample, padding left out.
        assert line["tokens_per_s"] / line["samples_per_s"] == pytest.approx(real / len(job.LENGTHS)), name


@pytest.mark.parametrize("way", ["accumulation", "ddp"])
def test_the_logged_loss_is_the_token_mean_of_the_whole_step(trained, way):
    model = job.hf_model()
    with torch.no_grad():
        loss = model(**default_collate(job.hf_samples())).loss.item()
    line = next(r for r in trained[(way, "hf")][1] if "loss" in r)
    assert line["loss"] == pytest.approx(loss, rel=1e-5)


@pytest.mark.parametrize("way", ["accumulation", "ddp"])
@pytest.mark.parametrize("name", ["hf", "gpt"])
def test_eval_loss_is_the_mean_over_the_targets_the_model_scores(trained, way, name):
    """Over eval batches of unequal real tokens (and, for the HF model, after its own shift)."""
    model = job.hf_model() if name == "hf" else job.gpt_model()
    model.load_state_dict(trained[(way, name)][0])
    with torch.no_grad():
        if name == "hf":
            loss = model(**default_collate(job.hf_samples())).loss
        else:
            inputs, targets = default_collate(job.gpt_samples())
            loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    line = next(r for r in trained[(way, name)][1] if "eval_loss" in r)
    assert line["eval_loss"] == pytest.approx(loss.item(), rel=1e-5)
