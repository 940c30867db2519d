"""Sharded training (parallel.strategy = fsdp | hsdp) against DDP, with real processes on gloo."""

import json
import re

import pytest

from helpers import WORKERS, assert_weights_close, dtrain, eval_lines, ok, train_lines, weights


@pytest.fixture(scope="module")
def fsdp(warm_torchrun, tmp_path_factory):
    """One launch of 2 processes: DDP and FSDP runs of a small GPT, a stop-and-resume, a bad unit name."""
    out = tmp_path_factory.mktemp("fsdp")
    launched = ok(warm_torchrun(WORKERS / "sharding.py", "fsdp", out))
    return out, json.loads((out / "results.json").read_text()), launched.stderr


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
    out, _, _ = fsdp
    assert_same_training(out / f"ddp_{name}", out / f"fsdp_{name}", 1e-5)
    if name == "accum_clip":
        assert all(m["grad_norm"] > 0.05 for m in train_lines(out / "fsdp_accum_clip"))  # clipping bit


@pytest.mark.parametrize(
    "plain, changed, tolerance",
    [
        ("ddp_plain", "ddp_full_ac", 0),
        ("fsdp_plain", "fsdp_selective_ac", 0),
        ("fsdp_plain", "fsdp_compiled", 1e-4),
        ("ddp_accum_clip", "ddp_compiled", 1e-4),  # with full activation checkpointing
    ],
)
def test_activation_checkpointing_and_compile_take_the_plain_steps(fsdp, plain, changed, tolerance):
    """Recomputing activations is exact; compiled kernels round differently, within a small tolerance."""
    out, _, console = fsdp
    assert_same_training(out / plain, out / changed, tolerance)
    if "compiled" in changed:
        mode = "blocks" if changed.startswith("fsdp") else "model"
        assert re.search(rf"compiled \({mode}\) in the first step: [0-9.]+ s, left out of throughput$", console, re.M)


def test_each_rank_holds_half_the_parameters_and_optimizer_state(fsdp):
    out, results, console = fsdp
    # As the run reports it (metrics.jsonl, measured from each rank's tensors): FSDP's half of DDP's.
    ddp, sharded = train_lines(out / "ddp_plain")[0], train_lines(out / "fsdp_plain")[0]
    for name in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        assert len(ddp[name]) == len(sharded[name]) == 2 and min(ddp[name]) > 0
        assert [s / d for s, d in zip(sharded[name], ddp[name])] == pytest.approx([0.5, 0.5], rel=0.05), name
    assert re.search(
        r"memory per rank \(fsdp 2; the most any of 2 holds\): parameters [0-9.]+ KiB, gradients", console, re.M
    )
    assert results["units"] == 2  # the GPT's two blocks, then the root
    for held, whole in (results["param_bytes"], results["optimizer_bytes"]):
        assert whole > 0 and held == pytest.approx(whole / 2, rel=0.05)


def test_fsdp_communication_reads_not_measured_rather_than_zero(fsdp):
    """FSDP's collectives run inside forward and backward: the step breakdown cannot tell them apart from
    compute, so metrics.jsonl leaves comm_ms out (DDP's is measured), the console and `dtrain report`
    say so, and the other phases are still there."""
    out, _, console = fsdp
    for record in train_lines(out / "ddp_plain"):
        assert record["comm_ms"] >= 0 and record["compute_ms"] > 0
    for record in train_lines(out / "fsdp_plain"):
        assert "comm_ms" not in record and record["compute_ms"] > 0 and record["step_ms"] > 0
    assert re.search(r"step [0-9.]+ ms = data [0-9.]+ \+ compute [0-9.]+ \+ comm not measured \+ optimizer", console)
    ok(dtrain("report", str(out / "fsdp_plain")))
    summary = (out / "fsdp_plain" / "report" / "summary.txt").read_text()
    assert "communication share: not measured (a sharded strategy's collectives run inside forward" in summary
    assert (out / "fsdp_plain" / "report" / "step_time.png").stat().st_size > 0


@pytest.mark.parametrize("name, ddp_steps", [("ddp_then_fsdp", [1, 2, 3, 4]), ("fsdp_then_ddp", [5, 6, 7, 8])])
def test_report_of_a_run_resumed_under_another_strategy_plots_comm_where_it_was_measured(fsdp, name, ddp_steps):
    """A run trained under one strategy and resumed under the other into the same run.dir: its
    metrics.jsonl has windows with comm_ms (DDP) and without (FSDP: inside compute). `dtrain report`'s
    step-time plot draws communication over the DDP windows, and over the FSDP ones no communication
    band (not a zero one) but compute marked as holding it; the other phases over all of them."""
    from dtrain.commands.report import build_figures, load_records, summary

    out, _, _ = fsdp
    train = train_lines(out / name)
    assert [m["step"] for m in train] == list(range(1, 9))
    assert [m["step"] for m in train if "comm_ms" in m] == ddp_steps
    figure = build_figures(load_records(out / name))["step_time"]
    spans: dict[str, list[tuple[float, float]]] = {}
    for band in figure.axes[0].collections:
        xs = band.get_paths()[0].vertices[:, 0]
        spans.setdefault(band.get_gid(), []).append((xs.min(), xs.max()))
    # The second stretch starts where the first ended: its first window covers the steps in between.
    ddp, fsdp = ((1, 4), (4, 8)) if ddp_steps[0] == 1 else ((4, 8), (1, 4))
    assert spans["comm"] == [ddp]
    assert sorted(spans["compute"]) == sorted([ddp, fsdp])
    assert sorted(spans["data"]) == sorted(spans["optimizer"]) == sorted([ddp, fsdp])
    legend = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    assert legend.count("comm") == 1 and "compute (comm inside)" in legend
    measured = sum(step > 1 for step in ddp_steps)  # the summary leaves the first window out: warm-up
    assert f"(in the {measured} of 7 logged windows that measured it" in summary(load_records(out / name))


def test_fsdp_resumes_bitwise(fsdp):
    out, _, _ = fsdp
    assert [m["loss"] for m in train_lines(out / "parted")] == [m["loss"] for m in train_lines(out / "fsdp_plain")]
    assert_weights_close(weights(out / "parted"), weights(out / "fsdp_plain"), atol=0, rtol=0)


def test_blocks_naming_no_module_is_one_line(fsdp):
    _, results, _ = fsdp
    assert results["bad_units"].startswith(
        "model.blocks = ['Nowhere']: Nowhere names no module of this model; its module classes are Block, "
    )
    # The GPT ties lm_head.weight to the token embedding: a Linear unit would shard one of them alone.
    assert results["tied_units"].startswith("model.blocks makes ") and "tied weights" in results["tied_units"]
    assert results["container_units"] == (
        "model.blocks names ModuleList, a container whose forward is "
        "never called; name the block class inside it (Block)"
    )


def test_hsdp_on_a_two_by_two_mesh_takes_the_steps_ddp_takes(warm_torchrun, tmp_path):
    ok(warm_torchrun(WORKERS / "sharding.py", "hsdp", tmp_path, nproc=4))
    results = json.loads((tmp_path / "results.json").read_text())
    for name in ("plain", "accum_clip"):
        assert_same_training(tmp_path / f"ddp_{name}", tmp_path / f"hsdp_{name}", 1e-5)
    held, whole = results["param_bytes"]
    assert held == pytest.approx(whole / 2, rel=0.05)  # sharded over 2, replicated over the other 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["parallel.strategy=fsdp", "training.precision=fp16"],
            "training.precision = 'fp16' needs a gradient scaler that knows the shards",
        ),
        (
            ["parallel.strategy=hsdp", "parallel.hsdp_shard_size=3"],
            "parallel.strategy = 'hsdp' shards over groups of 3 processes",
        ),
        (["parallel.strategy=fsdp", "ddp.comm_hook=fp16"], "ddp.comm_hook = 'fp16' is a DDP hook"),
        (
            ["training.compile=true", "CXX=no-such-c++"],
            "training.compile needs a C++ compiler to build CPU code and 'no-such-c++' (from CXX) is not on PATH",
        ),
        (["training.compile=true", "CXX="], "training.compile needs a C++ compiler and CXX is set but empty"),
        (
            ["training.compile=true", "CXX=/bin/false"],
            "training.compile needs a C++ compiler and '/bin/false' (from CXX) does not run as one",
        ),
        (
            ["training.activation_checkpointing=full"],  # found by a worker: the launcher does not build the model
            "training.activation_checkpointing and training.compile=blocks work block by block, and Sequential has no "
            "blocks dtrain can find",
        ),
    ],
)
def test_what_sharding_cannot_do_is_refused_by_the_launcher(tmp_path, overrides, message):
    environment = dict(o.split("=", 1) for o in overrides if o.startswith("CXX="))
    overrides = [o for o in overrides if not o.startswith("CXX=")]
    result = dtrain(
        "run",
        "examples/digits_mlp.toml",
        "--nproc",
        "2",
        f"run.dir={tmp_path / 'run'}",
        *overrides,
        extra_env=environment,
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and message in lines[0], result.stderr
    assert not (tmp_path / "run").exists()


# --- resuming on another number of processes -------------------------------------------------------

GPT = [
    "examples/gpt_stdlib.toml",
    "data.block_size=16",
    "data.batch_size=4",
    "training.grad_accum_steps=2",
    "training.max_steps=8",
    "training.log_every=1",
    "checkpoint.every_steps=4",
    "scheduler.warmup_steps=2",
    "model.options={n_layer = 2, n_head = 2, n_embd = 16}",
    "data.eval_batch_size=64",
]


@pytest.fixture(scope="module")
def tokens(json_byte_tokens):
    return json_byte_tokens


@pytest.fixture(scope="module")
def whole(warm, tokens, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("whole")
    ok(warm("run", *GPT, f"data.path={tokens}", "--nproc", "2", f"run.dir={run_dir}"))
    return run_dir


@pytest.mark.parametrize("before, after, accum", [("ddp", ("fsdp", 1), 4), ("fsdp", ("ddp", 4), 1)])
def test_a_checkpoint_of_2_processes_resumes_on_1_and_on_4(warm, tokens, whole, tmp_path, before, after, accum):
    """Same global batches after the resume (accumulation regrouped, and said), the loss curve the
    uninterrupted run took; from DDP to FSDP and back."""
    strategy, nproc = after
    ok(
        warm(
            "run",
            *GPT,
            f"data.path={tokens}",
            "--nproc",
            "2",
            f"run.dir={tmp_path}",
            f"parallel.strategy={before}",
            "training.stop_at_step=4",
        )
    )
    resumed = ok(
        warm(
            "run",
            *GPT,
            f"data.path={tokens}",
            "--nproc",
            str(nproc),
            f"run.dir={tmp_path}",
            f"parallel.strategy={strategy}",
        )
    )
    assert (
        f"step-4 was written by 2 processes and this run has {nproc}: training.grad_accum_steps 2 → {accum} "
        f"keeps its global batch of 16 samples"
    ) in resumed.stderr
    assert (
        f"the config changed since that checkpoint (parallel.strategy {before} → {strategy}): this run "
        f"follows it from step 4\n"
    ) in resumed.stderr
    losses, reference = [m["loss"] for m in train_lines(tmp_path)], [m["loss"] for m in train_lines(whole)]
    assert len(losses) == len(reference) == 8 and losses == pytest.approx(reference, abs=1e-5)
    assert eval_lines(tmp_path)[-1]["eval_loss"] == pytest.approx(eval_lines(whole)[-1]["eval_loss"], abs=1e-5)
    assert_weights_close(weights(tmp_path), weights(whole), atol=1e-5, rtol=0)
    assert f"grad_accum_steps = {accum}" in (tmp_path / "config.toml").read_text()
    # The same command again: the run's end was checkpointed by the regrouped run (its own accumulation, not
    # the config's); it is found complete, and nothing trains.
    again = ok(
        warm(
            "run",
            *GPT,
            f"data.path={tokens}",
            "--nproc",
            str(nproc),
            f"run.dir={tmp_path}",
            f"parallel.strategy={strategy}",
        )
    )
    assert again.stderr.strip().splitlines() == [
        f"dtrain: run.dir {tmp_path} is already complete (step 8 of 8, epoch 1 of 1); nothing to train — raise "
        f"training.epochs or training.max_steps to train on"
    ]
    assert [m["loss"] for m in train_lines(tmp_path)] == losses


def test_what_cannot_resume_on_another_number_of_processes_is_refused_by_the_launcher(tokens, whole, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(whole, run_dir)
    result = dtrain("run", *GPT, f"data.path={tokens}", "--nproc", "3", f"run.dir={run_dir}", "training.max_steps=12")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0] == (
        "dtrain: error: checkpoint step-8 trained on global batches of 16 samples (2 processes × 8); "
        "3 processes with data.batch_size=4 cannot make that up in whole accumulation steps: resume "
        "with a number of processes that divides 16"
    )
