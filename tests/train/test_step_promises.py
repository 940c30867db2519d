"""Promises about the step the README makes: no host read inside it, MFU against monitor.peak_tflops,
evaluation at training.eval_every epochs and the last."""

import pytest
import torch
from tiny import HIDDEN, IN, OUT
from tiny import small_config as config
from tiny import small_data as data
from tiny import small_model as model

import dtrain
from helpers import eval_lines, train_lines

# --- no host read inside the step -----------------------------------------------------------------


def test_the_training_step_never_reads_a_value_back_to_the_host(tmp_path, monkeypatch):
    """Every way Python code can pull a tensor's value to the host is counted while a step runs
    (between log steps): none may happen. Log steps read once, outside the step. The one exception is
    by torch's design: AdamW's step counter lives on the host (unless fused), so reading it waits for
    nothing — which is why a resume must leave it there."""
    inside = {"step": False}
    reads = []
    trainer = dtrain.Trainer(
        config(
            tmp_path, training={"max_grad_norm": 1.0, "grad_accum_steps": 2}, optimizer={"name": "adamw", "lr": 1e-3}
        ),
        model=model(),
        train_data=data(),
    )

    def host_counter(tensor):
        setup = getattr(trainer, "optimizer", None)
        return setup is not None and any(s.get("step") is tensor for s in setup.state.values())

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            if inside["step"] and not host_counter(self):
                reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    step = trainer._train_step

    def watched(run, micro_batches):
        inside["step"] = True
        try:
            step(run, micro_batches)
        finally:
            inside["step"] = False

    trainer._train_step = watched
    trainer.fit()
    assert trainer.step == 10 and reads == []


# --- MFU against monitor.peak_tflops ---------------------------------------------------------------


def test_mfu_is_reported_against_the_peak_the_user_gives(tmp_path):
    trainer = dtrain.Trainer(config(tmp_path, monitor={"peak_tflops": 0.5}), model=model(), train_data=data())
    trainer.fit()
    # The MLP's training FLOPs per sample, by hand: the first layer's forward and weight gradient
    # (its input needs no gradient), the second's forward, input and weight gradients; 2 per MAC.
    flops = 2 * IN * HIDDEN * 2 + 2 * HIDDEN * OUT * 3
    for m in train_lines(tmp_path):
        assert m["flops_per_sample"] == flops
        assert m["mfu"] == pytest.approx(flops * m["samples_per_s"] / 0.5e12, rel=1e-9)


def test_eval_every_evaluates_those_epochs_and_the_last(tmp_path):
    dtrain.Trainer(
        config(tmp_path, training={"epochs": 5, "eval_every": 2}),
        model=model(),
        train_data=data(),
        eval_data=data(40, 1),
    ).fit()
    assert [m["epoch"] for m in eval_lines(tmp_path)] == [2, 4, 5]
