"""Any batch, any loss, eval for any model: every batch shape through both sources on 2 real ranks,
and a clear line when a loss cannot be found."""

import dataclasses
import json
from collections import namedtuple
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dtrain.data.batch import collate, num_samples, num_tokens, split, to_device
from dtrain.errors import DtrainError
from dtrain.train.loss import LossOf
from helpers import WORKERS, ok

SHAPES = [
    "tensor_pair_fast",
    "tensor_pair_loader",
    "tensor_triple_fast",
    "dict_fast",
    "dict_loader",
    "nested_dict_loader",
    "namedtuple_loader",
    "dataclass_loader",
    "step_fn",
    "loss_fn_on_dict",
    "eval_metrics",
    "hf_batch_encoding",
]


@pytest.fixture(scope="module")
def shapes(warm_torchrun, tmp_path_factory):
    out = tmp_path_factory.mktemp("shapes")
    ok(warm_torchrun(WORKERS / "batch_shapes.py", out))
    return json.loads((out / "results.json").read_text())


def test_every_batch_shape_trains_the_same_model_to_the_same_weights(shapes):
    """Same samples, same order, same arithmetic: bitwise the same weights and eval loss, whichever
    shape the batch has, whichever source (index gather or DataLoader) serves it."""
    pytest.importorskip("transformers")  # the test extra installs it: BatchEncoding batches too
    assert sorted(shapes) == sorted(SHAPES)
    base = shapes["tensor_pair_fast"]
    assert base["steps"] == 8  # 60 samples a rank, 8 a micro-batch, 2 per step: 4 steps an epoch
    for name, result in shapes.items():
        assert result["weights"] == base["weights"], f"{name} trained to other weights"
        assert result["eval"]["eval_loss"] == base["eval"]["eval_loss"], name
        assert result["eval"]["eval_samples"] == 30, name


def test_eval_accuracy_only_where_outputs_are_class_scores(shapes):
    with_logits = {
        "tensor_pair_fast",
        "tensor_pair_loader",
        "tensor_triple_fast",
        "dict_fast",
        "dict_loader",
        "nested_dict_loader",
        "loss_fn_on_dict",
        "eval_metrics",
        "hf_batch_encoding",
    }
    for name, result in shapes.items():
        assert ("eval_accuracy" in result["eval"]) == (name in with_logits), name
    assert 0 < shapes["dict_fast"]["eval"]["eval_accuracy"] < 1


def test_user_eval_metrics_are_averaged_over_every_eval_sample(shapes):
    metrics = shapes["eval_metrics"]["eval"]
    assert metrics["eval_hits"] == pytest.approx(metrics["eval_accuracy"], abs=1e-12)
    g = torch.Generator().manual_seed(0)
    torch.randn(120, 6, generator=g)
    eval_y = torch.randn(30, 6, generator=g)[:, :3].argmax(1)
    assert metrics["eval_mean_target"] == pytest.approx(eval_y.double().mean().item(), abs=1e-12)


Pair = namedtuple("Pair", ["x", "y"])


@dataclasses.dataclass
class Sample:
    x: torch.Tensor
    meta: dict


def test_collate_and_to_device_keep_every_container():
    samples = [
        Sample(torch.tensor([i, i]), {"ids": torch.tensor(i), "pair": Pair(torch.tensor(i), i)}) for i in range(3)
    ]
    batch = to_device(collate(samples), torch.device("cpu"))
    assert isinstance(batch, Sample) and batch.x.shape == (3, 2)
    assert isinstance(batch.meta["pair"], Pair) and batch.meta["pair"].x.tolist() == [0, 1, 2]
    assert num_samples(batch) == 3
    assert split({"input_ids": 1, "labels": 2}) == ({"input_ids": 1, "labels": 2}, 2)
    assert split((1, 2, 3)) == ((1, 2), 3)
    assert split(Pair(1, 2)) == (Pair(1, 2), None)
    assert num_tokens(torch.zeros(4, 16, dtype=torch.long)) == 64 and num_tokens(torch.zeros(4)) is None


class NoLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x, labels=None):
        return {"logits": self.fc(x), "past_key_values": None}


@pytest.mark.parametrize(
    "loss_of, batch, message",
    [
        (
            LossOf(),
            {"x": torch.ones(3, 2)},
            "the model's output holds no loss (a dict with logits=Tensor, past_key_values=None); put the targets in "
            "the batch as 'labels' (a Hugging Face model then returns .loss), or pass Trainer(loss_fn=...) or "
            "Trainer(step_fn=...)",
        ),
        (
            LossOf(loss_fn=lambda out, target: (out["logits"] - 0).sum(1)),
            (torch.ones(3, 2), torch.zeros(3)),
            "loss_fn returned a tensor of shape (3,), not one number; return the batch's mean loss as a scalar tensor",
        ),
        (
            LossOf(step_fn=lambda model, batch: 1.0),
            (torch.ones(3, 2), torch.zeros(3)),
            "step_fn returned a float, not a tensor; return the batch's mean loss as a scalar tensor computed from the "
            "model's output",
        ),
    ],
)
def test_a_loss_that_cannot_be_found_is_one_line_naming_what_was_there(loss_of, batch, message):
    with pytest.raises(DtrainError) as refused:
        loss_of(NoLoss(), batch)
    assert str(refused.value) == message


def test_the_default_loss_counts_every_position_of_a_sequence():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g).requires_grad_()
    target = torch.randint(0, 7, (2, 5), generator=g)
    target[0, 0] = -100  # left out, as in every Hugging Face model
    loss, _, _ = LossOf()(lambda x: logits, (torch.zeros(2, 5), target))
    keep = target.flatten() != -100
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1)[keep], target.flatten()[keep])
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-7)  # masked by -100, not by hand: rounding
    assert LossOf()(lambda x: SimpleNamespace(loss=logits.sum()), {"x": 1})[0] == logits.sum()


def test_eval_metrics_of_the_wrong_kind_are_one_line():
    from dtrain.train.evaluation import EvalSums

    for returned, message in (
        ("great", "eval_metrics returned str; return a dict of names to numbers"),
        ({"m": "great"}, "eval_metrics returned m=str; return one number per name"),
    ):
        sums = EvalSums(torch.device("cpu"), lambda output, batch, r=returned: r)
        with pytest.raises(DtrainError, match=message):
            sums.add(torch.tensor(1.0), torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), None, 2, None)
