"""The Trainer as a library: what it holds before set-up, `evaluate()` before `setup()`, and the caller's
Config left as it was given when a resume changes the accumulation (config.toml says what was used)."""

import json

import pytest
import tiny
import tomllib
import torch

import dtrain
from helpers import dtrain as dtrain_cli


def data(n=96, seed=0):
    return tiny.small_data(n, seed)


def config(run_dir, **sections):
    return tiny.job_config(
        run_dir, {**tiny.SMALL, "training": {"epochs": 2, "log_every": 3}, "monitor": {"trackers": []}}, sections
    )


model = tiny.small_model


def test_evaluate_before_setup_sets_the_run_up_and_evaluates_every_sample(tmp_path):
    trainer = dtrain.Trainer(config(tmp_path / "run"), model=model(), train_data=data(), eval_data=data(40, seed=1))
    # Declared before set-up, empty until it runs.
    assert (trainer.optimizer, trainer.checkpointer, trainer.monitor, trainer.total_steps) == (None, None, None, 0)
    before = trainer.evaluate()
    assert trainer.session is not None and trainer.optimizer is not None  # it set the run up to evaluate
    assert before["eval_samples"] == 40 and before["eval_loss"] > 0 and 0 <= before["eval_accuracy"] <= 1
    assert trainer.evaluate() == before  # the same untrained weights, the same numbers
    trainer.fit()  # the set-up it did is the one fit() uses
    assert trainer.step == trainer.total_steps == 12
    assert trainer.evaluate()["eval_loss"] < before["eval_loss"]


def test_evaluate_without_eval_data_is_empty_and_needs_no_setup(tmp_path):
    trainer = dtrain.Trainer(config(tmp_path / "run"), model=model(), train_data=data())
    assert trainer.evaluate() == {}
    assert trainer.session is None and not (tmp_path / "run").exists()


def test_a_regrouped_resume_leaves_the_callers_config_as_given(tmp_path):
    """data.batch_size halved on resume: the run takes 2 accumulation steps to keep the checkpoint's global
    batch. The Config the caller passed still says 1; the trainer and config.toml say 2."""
    run_dir = tmp_path / "run"
    dtrain.Trainer(config(run_dir, training={"stop_at_step": 4}), model=model(), train_data=data()).fit()
    given = config(run_dir, data={"batch_size": 8})
    trainer = dtrain.Trainer(given, model=model(), train_data=data())
    trainer.fit()
    assert given.training.grad_accum_steps == 1 and given.data.batch_size == 8  # the caller's, untouched
    assert trainer.step == 12 and trainer.grad_accum_steps == 2
    assert trainer.config is not given and trainer.config.training.grad_accum_steps == 2
    written = tomllib.loads((run_dir / "config.toml").read_text())
    assert written["training"]["grad_accum_steps"] == 2 and written["data"]["batch_size"] == 8


class OwnLoss(torch.nn.Module):
    """A model that computes its loss itself, given the labels, and returns it with the logits as
    `shape` says: a (loss, logits) tuple (a Hugging Face model with return_dict=False), (logits, loss),
    or a dict."""

    def __init__(self, shape: str):
        super().__init__()
        self.net, self.shape = model(), shape

    def forward(self, x, labels):
        logits = self.net(x)
        loss = torch.nn.functional.cross_entropy(logits, labels)
        return {"tuple": (loss, logits), "reversed": (logits, loss), "dict": {"loss": loss, "logits": logits}}[
            self.shape
        ]


def dict_data(n=96, seed=0):
    return [{"x": x, "labels": y} for x, y in data(n, seed)]


def test_a_model_returning_loss_and_logits_as_a_tuple_trains_like_one_returning_a_dict(tmp_path):
    runs = {}
    for shape in ("tuple", "dict"):
        net = OwnLoss(shape)
        trainer = dtrain.Trainer(
            config(tmp_path / shape), model=net, train_data=dict_data(), eval_data=dict_data(40, seed=1)
        )
        runs[shape] = trainer.fit(), net.state_dict()
    (tuple_result, tuple_weights), (dict_result, dict_weights) = runs["tuple"], runs["dict"]
    numbers = ("loss", "eval_loss", "eval_accuracy")  # eval_accuracy: the logits are found in the tuple too
    assert [tuple_result[k] for k in numbers] == [dict_result[k] for k in numbers]
    assert all(torch.equal(tuple_weights[name], dict_weights[name]) for name in dict_weights)


def test_a_tuple_whose_loss_is_not_first_is_refused_with_advice_that_works(tmp_path):
    with pytest.raises(dtrain.DtrainError) as refused:
        dtrain.Trainer(config(tmp_path / "refused"), model=OwnLoss("reversed"), train_data=dict_data()).fit()
    advice = "Trainer(loss_fn=lambda output, batch: output[1])"
    assert str(refused.value) == (
        "the model returned a tuple of 2 (a tensor of shape (16, 3), a tensor of shape ()); dtrain takes a "
        "tuple's first element as the loss when it is one number, and here it is element 1: return "
        f"(loss, ...) first, or pass {advice}"
    )
    advised = lambda output, batch: output[1]  # noqa: E731 — the advice, as written
    trainer = dtrain.Trainer(
        config(tmp_path / "advised"), model=OwnLoss("reversed"), train_data=dict_data(), loss_fn=advised
    )
    assert trainer.fit()["loss"] > 0 and trainer.step == trainer.total_steps


def test_a_tied_embedding_models_weights_load_strictly_through_load_weights(tmp_path):
    """GPT-2 ties lm_head to wte: model.safetensors holds the tensor once (safetensors refuses shared
    tensors), and dtrain.load_weights gives it back under both names, for a strict load_state_dict."""
    pytest.importorskip("transformers")
    from hf_gpt2 import samples, tiny_gpt2
    from safetensors.torch import load_file

    trained = tiny_gpt2()
    dtrain.Trainer(config(tmp_path / "run", training={"max_steps": 2}), model=trained, train_data=samples(16)).fit()
    weights = tmp_path / "run" / "model.safetensors"
    assert len(load_file(weights)) == len(trained.state_dict()) - 1  # the tied tensor stored once
    with pytest.raises(RuntimeError, match="Missing key"):  # what the file alone gives a strict load
        tiny_gpt2().load_state_dict(load_file(weights))
    fresh = tiny_gpt2()
    fresh.load_state_dict(dtrain.load_weights(weights), strict=True)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight  # still tied
    ids = samples(2)[0]["input_ids"][None]
    trained.eval(), fresh.eval()
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, trained(ids).logits)
    assert not torch.equal(tiny_gpt2()(ids).logits, trained(ids).logits)  # it did train


def test_an_api_runs_config_toml_says_its_model_was_given_in_code(tmp_path):
    """config.toml of a run given its model and data in code holds defaults in [model] and [data]: its
    first line says so, `dtrain generate` does not build the default model from it, and `dtrain run`
    on it does not train that model in the run's name."""
    run_dir = tmp_path / "run"
    dtrain.Trainer(config(run_dir), model=model(), train_data=data()).fit()
    config_file = run_dir / "config.toml"
    assert config_file.read_text().splitlines()[0] == (
        "# The resolved config of this run, written by dtrain. Its model and data were given in code to "
        "dtrain.Trainer, not built from [model] and [data]: rerun it with the script that trained it"
    )
    sampled = dtrain_cli("generate", str(run_dir))
    assert sampled.returncode == 2 and sampled.stderr.splitlines() == [
        f"dtrain: error: {run_dir} was trained by a script that gave dtrain.Trainer its model in code, which "
        f"config.toml cannot build; sample in that script: load the weights with "
        f"model.load_state_dict(dtrain.load_weights('{run_dir / 'model.safetensors'}')) and call the model's "
        f"own generate"
    ]
    rerun = dtrain_cli("run", str(config_file), f"run.dir={tmp_path / 'rerun'}")
    assert rerun.returncode == 2 and rerun.stderr.splitlines() == [
        f"dtrain: error: {config_file} is the config of a run whose model and data were given in code to "
        f"dtrain.Trainer; dtrain run would train [model] and [data] as written instead: rerun the script that "
        f"trained it (dtrain launch SCRIPT), or delete the file's first line to train what it says"
    ]
    assert not (tmp_path / "rerun").exists()


def test_an_empty_eval_set_is_said_once_not_evaluated(tmp_path, capfd):
    """eval_data with no sample: one note at set-up, and no eval record (it held a step and no metric)."""
    empty = torch.utils.data.TensorDataset(*(t[:0] for t in data().tensors))
    dtrain.Trainer(config(tmp_path / "run"), model=model(), train_data=data(), eval_data=empty).fit()
    notes = [line for line in capfd.readouterr().err.splitlines() if line.startswith("note:")]
    assert notes == ["note: eval_data holds no samples: this run does not evaluate"]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records and not any("eval_loss" in record for record in records)
    assert all("loss" in record or "checkpoint" in record for record in records)  # the end's checkpoint logged too


def test_a_loss_that_never_changes_is_said_once(tmp_path, capfd):
    """A loss computed from nothing the model learns (every gradient zero): the same loss in every window,
    said once after 50 steps, and the run goes on to its end. A run that learns says nothing of it."""

    def constant_loss(output, target):
        return output.sum() * 0 + 1.0

    sections = {"training": {"epochs": 7, "log_every": 10}, "data": {"batch_size": 8}}  # 12 steps an epoch
    stuck = dtrain.Trainer(
        config(tmp_path / "stuck", **sections), model=model(), train_data=data(), loss_fn=constant_loss
    )
    stuck.fit()
    said = [line for line in capfd.readouterr().err.splitlines() if "nothing trains" in line]
    assert stuck.step == 84 and said == [
        "warning: the training loss has been exactly 1 for 50 steps (steps 1–50): nothing trains. Check that the "
        "parameters require gradients, that the loss is computed from the model's output, and that optimizer.lr "
        "is not 0"
    ]
    dtrain.Trainer(config(tmp_path / "learns", **sections), model=model(), train_data=data()).fit()
    assert "nothing trains" not in capfd.readouterr().err


def test_an_optimizer_and_scheduler_given_in_code_train_and_resume_exactly(tmp_path):
    """Trainer(optimizer=..., scheduler=...) as objects over the model's parameters, or as factories (of
    the parameter groups, resp. the optimizer); stopped and resumed, the factories' run ends with the
    uninterrupted run's weights bit for bit. An optimizer over other parameters is refused in one line."""

    def adam(params):
        return torch.optim.Adam(params, lr=0.01, weight_decay=0.1)

    def steps(optimizer):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)

    net = model()
    optimizer = torch.optim.RMSprop(net.parameters(), lr=0.005)
    trainer = dtrain.Trainer(config(tmp_path / "objects"), model=net, train_data=data(), optimizer=optimizer)
    trainer.fit()
    assert trainer.optimizer is optimizer and trainer.step == 12

    whole = dtrain.Trainer(
        config(tmp_path / "whole"), model=model(), train_data=data(), optimizer=adam, scheduler=steps
    )
    whole.fit()
    assert type(whole.optimizer) is torch.optim.Adam and type(whole.scheduler) is torch.optim.lr_scheduler.StepLR
    # The factory got optimizer.no_decay's groups: the biases at weight_decay 0, the matrices at Adam's 0.1.
    assert sorted(g["weight_decay"] for g in whole.optimizer.param_groups) == [0.0, 0.1]
    assert whole.optimizer.param_groups[0]["lr"] == 0.01 * 0.5**3  # 12 steps of StepLR(4, 0.5)
    run = tmp_path / "stopped"
    dtrain.Trainer(
        config(run, training={"stop_at_step": 5}), model=model(), train_data=data(), optimizer=adam, scheduler=steps
    ).fit()
    resumed = dtrain.Trainer(config(run), model=model(), train_data=data(), optimizer=adam, scheduler=steps)
    resumed.fit()
    for a, b in zip(whole.module.state_dict().values(), resumed.module.state_dict().values()):
        assert torch.equal(a, b)

    foreign = torch.optim.SGD(model().parameters(), lr=0.1)
    with pytest.raises(dtrain.DtrainError, match=r"^Trainer\(optimizer=\.\.\.\) holds parameters the model does not"):
        dtrain.Trainer(config(tmp_path / "foreign"), model=model(), train_data=data(), optimizer=foreign).setup()
