"""Evaluation as practitioners run it (eval every N steps, a capped eval split, whole-split metrics),
proven with real processes: 2 and 3 CPU workers on gloo under torchrun."""

import json

import pytest

from helpers import WORKERS, eval_lines, ok, torchrun, train_lines


@pytest.fixture(scope="module")
def two_ranks(warm_torchrun, tmp_path_factory):
    """One launch, several checks (starting processes is the slow part)."""
    out = tmp_path_factory.mktemp("eval2")
    ok(warm_torchrun(WORKERS / "eval_practice.py", out, nproc=2))
    return out, json.loads((out / "results.json").read_text())


def test_eval_every_steps_evaluates_every_n_steps_besides_each_epoch_and_the_end(two_ranks):
    out, _ = two_ranks
    # 3 steps an epoch, 6 in all: every 2 steps (2, 4, 6) and each epoch's end (3, 6), once each.
    assert [line["step"] for line in eval_lines(out / "steps")] == [2, 3, 4, 6]


def test_eval_batches_evaluates_the_same_samples_every_time_and_at_any_world_size(two_ranks, tmp_path):
    from scenarios import config, data, fresh_model

    import dtrain
    from dtrain.export.weights import load_weights

    out, _ = two_ranks
    lines = eval_lines(out / "steps")
    assert {line["eval_samples"] for line in lines} == {30}  # 3 batches of 10, shared by the 2 ranks
    assert len({round(line["eval_x0"], 12) for line in lines}) == 1
    assert len({line["eval_loss"] for line in lines}) == len(lines)  # the weights did change
    # One process, the run's final weights, the same cap: the same samples, the same numbers.
    model = fresh_model()
    model.load_state_dict(load_weights(out / "steps" / "model.safetensors"))
    one = dtrain.Trainer(
        config(tmp_path, {"data": {"eval_batch_size": 10}}, eval_batches=3),
        model=model,
        train_data=data(96, 0),
        eval_data=data(101, 1),
        eval_metrics=lambda output, batch: {"x0": batch[0][:, 0].mean()},
    ).evaluate()
    last = lines[-1]
    assert one["eval_samples"] == 30
    assert abs(one["eval_x0"] - last["eval_x0"]) < 1e-6  # float32 batch means; another sample: ~0.1 off
    assert abs(one["eval_loss"] - last["eval_loss"]) < 1e-6
    assert abs(one["eval_accuracy"] - last["eval_accuracy"]) < 1e-9


def _check_whole_split_f1(results):
    scored = results["whole_split"]
    assert scored["eval_seen"] == 101 == scored["eval_samples"]  # not 102 or 103: no padding duplicate
    assert scored["eval_in_order"] == 1.0
    assert 0 < scored["eval_f1"] < 1
    assert abs(scored["eval_f1"] - results["sklearn_f1"]) < 1e-12


def test_a_whole_split_f1_equals_sklearns_at_two_ranks(two_ranks):
    _check_whole_split_f1(two_ranks[1])
    assert "eval_f1" in eval_lines(two_ranks[0] / "f1")[-1]  # and the run's own eval lines carry it


def test_a_whole_split_f1_equals_sklearns_at_three_ranks(tmp_path):
    ok(torchrun(WORKERS / "eval_practice.py", tmp_path, nproc=3))
    _check_whole_split_f1(json.loads((tmp_path / "results.json").read_text()))


def test_keep_best_keeps_the_best_checkpoint_through_pruning_and_a_resume(two_ranks):
    out, results = two_ranks
    lines = eval_lines(out / "best")
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5, 6]  # each step evaluated (and checkpointed) once
    evals = {line["step"]: line["eval_loss"] for line in lines}
    best = max(evals, key=evals.get)  # keep_best = "eval_loss:max"
    assert best < 4  # the best is neither the newest at the stop nor at the end: pruning would take it
    assert results["kept_after_4"] == ["best.json", f"step-{best}", "step-4"]
    assert results["kept_after_0"] == ["best.json", f"step-{best}", "step-6"]
    said = json.loads((out / "best" / "checkpoints" / "best.json").read_text())
    assert (said["step"], said["metric"], said["mode"]) == (best, "eval_loss", "max")
    assert said["value"] == evals[best]


def test_checkpoint_every_epochs_writes_at_each_epochs_end(two_ranks):
    out, _ = two_ranks
    assert sorted(p.name for p in (out / "epochs" / "checkpoints").iterdir()) == ["step-3", "step-6"]


def test_eval_records_carry_the_mean_training_loss_since_the_last_evaluation(two_ranks):
    out, _ = two_ranks
    said = {line["step"]: line["train_loss"] for line in eval_lines(out / "steps")}
    logged = {line["step"]: line["loss"] for line in train_lines(out / "steps")}  # log_every=4: steps 1-4, 5-6
    assert sorted(logged) == [4, 6]
    # Evaluations at 2, 3, 4 split the first logged window (2 steps, 1, 1); the one at 6 is the second window.
    assert abs((2 * said[2] + said[3] + said[4]) / 4 - logged[4]) < 1e-6
    assert abs(said[6] - logged[6]) < 1e-6
    assert len(set(said.values())) == 4


def test_a_resume_from_a_step_eval_every_steps_evaluated_logs_that_evaluation_once(tmp_path):
    """What a kill after step 4's evaluation leaves: checkpoints to step 4, metrics.jsonl beyond it."""
    import shutil

    from scenarios import config, data, fresh_model

    import dtrain

    def job():
        every = {"checkpoint": {"every_steps": 1, "keep": 10}, "data": {"batch_size": 32}}
        return config(tmp_path, every, eval_every_steps=2, eval_every=0)

    dtrain.Trainer(job(), model=fresh_model(), train_data=data(96, 0), eval_data=data(20, 1)).fit()
    for step in (5, 6):
        shutil.rmtree(tmp_path / "checkpoints" / f"step-{step}")
    (tmp_path / "model.safetensors").unlink()
    dtrain.Trainer(job(), model=fresh_model(), train_data=data(96, 0), eval_data=data(20, 1)).fit()
    assert [line["step"] for line in eval_lines(tmp_path)] == [2, 4, 6]
