"""The recipe, proven with real processes: 2 CPU workers on gloo under torchrun."""

import json

import pytest
import torch
import torch.nn.functional as F

from helpers import ROOT, WORKERS, assert_weights_close, dtrain, eval_lines, ok, torchrun, train_lines, weights


@pytest.fixture(scope="module")
def shared(warm_torchrun, tmp_path_factory):
    """One torchrun launch, several checks (starting processes is the slow part)."""
    out = tmp_path_factory.mktemp("shared")
    ok(warm_torchrun(WORKERS / "scenarios.py", "shared", out))
    return out, json.loads((out / "results.json").read_text())


def test_parity_with_a_plain_ddp_loop(shared):
    out, results = shared
    ours = [m["loss"] for m in train_lines(out / "parity")]
    plain = results["plain_losses"]
    assert len(ours) == len(plain) == 2 * 7  # 102 samples per rank, batch 16: 7 steps an epoch
    assert results["parity_used_shared_memory"]  # dtrain's CPU all-reduce, against gloo's
    for step, (a, b) in enumerate(zip(ours, plain), start=1):
        assert abs(a - b) <= 1e-6, f"step {step}: dtrain {a} vs plain DDP {b}"
    assert results["parity_weights_equal_plain"]  # and the very same final weights


def test_the_shared_memory_average_is_bitwise_equal_to_gloos_at_two_ranks(shared):
    _, results = shared
    assert results["parity_used_shared_memory"] and not results["gloo_used_shared_memory"]
    assert results["gloo_weights_equal_shared_memory"]


def test_the_shared_memory_average_gives_every_rank_the_same_numbers_at_three_ranks(tmp_path):
    """At 3 ranks a sum's order changes its rounding: every rank must still hold bitwise the same average."""
    ok(torchrun(WORKERS / "shm_average.py", tmp_path, nproc=3))
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["used_shared_memory"] and results["ranks_bitwise_equal"]
    assert results["max_error_vs_float64_mean"] <= 1e-6 * results["largest_value"]


def test_static_graph_and_find_unused_parameters_train(shared):
    out, results = shared
    assert results["static_graph_set"] and results["static_weights_equal"]
    losses = [m["loss"] for m in train_lines(out / "unused")]
    assert losses[-1] < 0.8 * losses[0] and results["unused_extra_unchanged"]


def test_dataloader_path_takes_the_same_steps(shared):
    out, _ = shared
    assert [m["loss"] for m in train_lines(out / "loader")] == [m["loss"] for m in train_lines(out / "parity")]
    assert_weights_close(weights(out / "loader"), weights(out / "parity"), atol=0, rtol=0)  # bitwise


def test_eval_is_exact_when_the_world_size_does_not_divide_the_data(shared):
    _, results = shared
    two, one = results["eval_2_ranks"], results["eval_1_process"]
    assert two["eval_samples"] == 101  # not 102: the sample DistributedSampler would pad is not counted
    assert abs(two["eval_loss"] - one["eval_loss"]) < 1e-6
    assert abs(two["eval_accuracy"] - one["eval_accuracy"]) < 1e-6
    correct = two["eval_accuracy"] * 101
    assert abs(correct - round(correct)) < 1e-9  # a count of samples over 101, not over 102


def test_accumulation_skips_the_allreduce_on_all_but_the_last_micro_batch(shared):
    _, results = shared
    # 3 optimizer steps of 4 micro-batches each: 3 all-reduces, not 12.
    assert results["accum_steps"] == 3
    assert results["allreduce_calls"] == 3
    assert results["shared_memory_calls"] == 3


@pytest.mark.parametrize("hook, registered", [("fp16", "fp16_compress_hook"), ("powersgd", "powerSGD_hook")])
def test_a_compression_hook_takes_ddps_slot_and_trains(shared, hook, registered):
    out, results = shared
    assert results[f"hook_{hook}"] == {"registered": [registered], "shared_memory": False}
    losses = [m["loss"] for m in train_lines(out / f"hook_{hook}")]
    plain = [m["loss"] for m in train_lines(out / "parity")]
    assert len(losses) == len(plain) and losses[-1] < 0.8 * losses[0]  # it learns
    if hook == "fp16":  # half-precision gradients: close to the plain run, yet not the same numbers
        assert losses != plain and max(abs(a - b) for a, b in zip(losses, plain)) < 0.05
    # DDP's own measurement of the all-reduce stands in for the hook dtrain no longer holds.
    assert all(m["comm_ms"] > 0 for m in train_lines(out / f"hook_{hook}")[1:])


def test_a_group_the_user_made_is_left_alone(shared):
    assert shared[1]["group_alive_after_user_owned_fit"] is True


def test_the_process_group_is_destroyed_on_success_and_on_error(tmp_path):
    ok(torchrun(WORKERS / "scenarios.py", "owned", tmp_path))
    results = json.loads((tmp_path / "results.json").read_text())
    assert results == {"alive_after_success": False, "error": "loss exploded", "alive_after_error": False}


def test_accumulating_4_micro_batches_equals_one_batch_4_times_larger(shared):
    # 102 samples per rank: the last step holds 6 samples (4 + 2 when accumulating).
    out, _ = shared
    accum, big = train_lines(out / "accum4"), train_lines(out / "batch16")
    assert len(accum) == len(big) == 2 * 7
    for a, b in zip(accum, big):
        assert abs(a["loss"] - b["loss"]) < 1e-5
    assert_weights_close(weights(out / "accum4"), weights(out / "batch16"))


def test_a_global_batch_size_is_split_over_the_processes_as_accumulation(shared):
    """training.global_batch_size = 32 with data.batch_size = 4 on 2 processes is 4 micro-batches a step:
    the very run that says grad_accum_steps = 4."""
    out, results = shared
    assert results["global32_accum"] == 4
    assert [m["loss"] for m in train_lines(out / "global32")] == [m["loss"] for m in train_lines(out / "accum4")]
    assert_weights_close(weights(out / "global32"), weights(out / "accum4"), atol=0, rtol=0)


def test_two_ranks_of_b_equal_one_rank_of_2b(shared, tmp_path):
    """The 2-rank × 8 run happened in the shared launch; the 1-rank × 16 run happens here."""
    from scenarios import config, data, fresh_model

    import dtrain

    out, _ = shared
    one = dtrain.Trainer(config(tmp_path, {"data": {"batch_size": 16}}), model=fresh_model(), train_data=data(200, 0))
    one.fit()
    assert len(train_lines(out / "two_ranks")) == len(train_lines(tmp_path)) == 2 * 13
    assert_weights_close(weights(out / "two_ranks"), weights(tmp_path))


def test_bf16_autocast_on_cpu_runs_and_learns(shared):
    out, results = shared
    lines = train_lines(out / "bf16")
    assert lines[-1]["loss"] < 0.6 * lines[0]["loss"]
    assert results["bf16"]["eval_accuracy"] > 0.7  # chance is 0.25
    assert all(0 < m["grad_norm"] < 1e3 for m in lines)  # clipping on: the norm is logged
    assert results["bf16_output_dtype"] == "torch.bfloat16"  # the forward really ran in bf16


def test_fp16_on_cpu_is_refused_clearly(tmp_path):
    result = dtrain(
        "run", "examples/digits_mlp.toml", "--nproc", "2", "training.precision=fp16", f"run.dir={tmp_path / 'run'}"
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "dtrain: error: training.precision = 'fp16' needs a CUDA GPU (fp16 "
        "autocast with GradScaler); on this CPU use training.precision=bf16 or fp32"
    )
    assert not (tmp_path / "run").exists()


def test_the_main_job(warm, tmp_path):
    """The README's first command: the guide's MLP on digits, 2 processes, >= 95% held-out accuracy."""
    run_dir = tmp_path / "digits"
    ok(warm("run", "examples/digits_mlp.toml", "--nproc", "2", "monitor.flops=yes", f"run.dir={run_dir}"))

    final = eval_lines(run_dir)[-1]
    assert final["eval_accuracy"] >= 0.95
    assert final["eval_samples"] == 359

    # metrics.jsonl: one object per logged step with the promised fields.
    lines = train_lines(run_dir)
    assert [m["step"] for m in lines] == list(range(10, 241, 10))
    for m in lines:
        assert {"step", "epoch", "loss", "lr", "samples_per_s"} <= m.keys() and m["samples_per_s"] > 0
    assert len(eval_lines(run_dir)) == 20  # every epoch

    # Where each step went: every rank's four phases lie inside its own step time (the rest is logging
    # between steps) and cover most of it, every rank's busy time is there, and the FLOP count is the
    # MLP's.
    def phases(m):
        return m["data_ms"] + m["compute_ms"] + m["comm_ms"] + m["optimizer_ms"]

    timed = lines[1:]  # the first window holds start-up
    assert sum(map(phases, timed)) >= 0.6 * sum(m["step_ms"] for m in timed)
    for m in timed:
        assert 0.3 * m["step_ms"] <= phases(m) <= m["step_ms"], m
        assert m["comm_ms"] > 0 and len(m["rank_busy_ms"]) == 2
        assert m["flops_per_sample"] == 3 * 2 * (64 * 1024 + 1024 * 10) - 2 * 64 * 1024  # no input grad

    # The resolved config was written and reads back as the job that ran.
    from dtrain.config import load_config

    assert load_config(run_dir / "config.toml") == load_config(
        ROOT / "examples" / "digits_mlp.toml", ["monitor.flops=yes", f"run.dir={run_dir}"]
    )

    # Real TensorBoard event files holding the same numbers.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/samples_per_s", "eval/loss", "eval/accuracy"} <= tags
    layout = events.Tensors("run/layout/text_summary")  # how the processes split the job, as text, once
    assert [e.tensor_proto.string_val for e in layout] == [[b"dp 2"]]
    assert [e.step for e in events.Scalars("train/loss")] == [m["step"] for m in lines]
    # The same values, not only the same steps (TensorBoard keeps float32).
    for tag, key, records in (
        ("train/loss", "loss", lines),
        ("train/lr", "lr", lines),
        ("time/comm_ms", "comm_ms", lines),
        ("eval/loss", "eval_loss", eval_lines(run_dir)),
        ("eval/accuracy", "eval_accuracy", eval_lines(run_dir)),
    ):
        assert [e.value for e in events.Scalars(tag)] == pytest.approx([m[key] for m in records], rel=1e-6), tag
    assert events.Scalars("eval/accuracy")[-1].value == pytest.approx(final["eval_accuracy"], rel=1e-6)

    # The saved weights are the trained model: they reproduce the logged accuracy.
    from dtrain import data, models

    cfg = load_config(run_dir / "config.toml")
    splits = data.build(cfg)
    model = models.build(cfg.model, splits.input_shape, splits.num_classes)
    model.load_state_dict(weights(run_dir))
    x, y = splits.eval.tensors
    with torch.no_grad():
        out = model(x)
    assert (out.argmax(1) == y).float().mean().item() == pytest.approx(final["eval_accuracy"], abs=1e-6)
    assert F.cross_entropy(out, y).item() == pytest.approx(final["eval_loss"], rel=1e-5)
