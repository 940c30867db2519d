"""Sharded training (distributed.strategy = fsdp | hsdp) against DDP, with real processes on gloo."""

import json

import pytest

from helpers import WORKERS, assert_weights_close, dtrain, eval_lines, ok, torchrun, train_lines, weights


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    """One launch of 2 processes: DDP and FSDP runs of a small GPT, a stop-and-resume, a bad unit name."""
    out = tmp_path_factory.mktemp("fsdp")
    ok(torchrun(WORKERS / "sharding.py", "fsdp", out))
    return out, json.loads((out / "results.json").read_text())


def assert_same_training(a, b, tolerance):
    losses_a, losses_b = [m["loss"] for m in train_lines(a)], [m["loss"] for m in train_lines(b)]
    assert len(losses_a) == len(losses_b) == 8
    assert losses_a == pytest.approx(losses_b, abs=tolerance), (losses_a, losses_b)
    evals_a, evals_b = [m["eval_loss"] for m in eval_lines(a)], [m["eval_loss"] for m in eval_lines(b)]
    assert len(evals_a) == len(evals_b) >= 1 and evals_a == pytest.approx(evals_b, abs=tolerance)
    assert_weights_close(weights(a), weights(b), atol=tolerance, rtol=0)


@pytest.mark.parametrize("name", ["plain", "accum_clip"])
def test_fsdp_takes_the_steps_ddp_takes(fsdp, name):
    """Per-step losses, exact eval (ranks with unequal eval batches) and final weights, within 1e-5 —
    with gradient accumulation and clipping by the global norm too."""
    out, _ = fsdp
    assert_same_training(out / f"ddp_{name}", out / f"fsdp_{name}", 1e-5)
    if name == "accum_clip":
        assert all(m["grad_norm"] > 0.05 for m in train_lines(out / "fsdp_accum_clip"))  # clipping bit


def test_each_rank_holds_half_the_parameters_and_optimizer_state(fsdp):
    _, results = fsdp
    assert results["units"] == 2  # the GPT's two blocks, then the root
    for held, whole in (results["param_bytes"], results["optimizer_bytes"]):
        assert whole > 0 and held == pytest.approx(whole / 2, rel=0.05)


def test_fsdp_resumes_bitwise(fsdp):
    out, _ = fsdp
    assert [m["loss"] for m in train_lines(out / "parted")] == [m["loss"] for m in train_lines(out / "fsdp_plain")]
    assert_weights_close(weights(out / "parted"), weights(out / "fsdp_plain"), atol=0, rtol=0)


def test_fsdp_units_naming_no_module_is_one_line(fsdp):
    _, results = fsdp
    assert results["bad_units"].startswith("distributed.fsdp_units = ['Nowhere'] names no module of this model; "
                                           "its module classes are Block, ")


def test_hsdp_on_a_two_by_two_mesh_takes_the_steps_ddp_takes(tmp_path):
    ok(torchrun(WORKERS / "sharding.py", "hsdp", tmp_path, nproc=4))
    results = json.loads((tmp_path / "results.json").read_text())
    for name in ("plain", "accum_clip"):
        assert_same_training(tmp_path / f"ddp_{name}", tmp_path / f"hsdp_{name}", 1e-5)
    held, whole = results["param_bytes"]
    assert held == pytest.approx(whole / 2, rel=0.05)  # sharded over 2, replicated over the other 2


@pytest.mark.parametrize("overrides, message", [
    (["distributed.strategy=fsdp", "training.precision=fp16"],
     "training.precision = 'fp16' needs a gradient scaler that knows the shards"),
    (["distributed.strategy=hsdp", "distributed.hsdp_shard_size=3"],
     "distributed.strategy = 'hsdp' shards over groups of 3 processes"),
    (["distributed.strategy=fsdp", "distributed.comm_hook=fp16"],
     "distributed.comm_hook = 'fp16' is a DDP hook"),
])
def test_what_sharding_cannot_do_is_refused_by_the_launcher(tmp_path, overrides, message):
    result = dtrain("run", "examples/digits_mlp.toml", "--nproc", "2", f"run.dir={tmp_path / 'run'}", *overrides)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and message in lines[0], result.stderr
    assert not (tmp_path / "run").exists()
