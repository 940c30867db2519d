"""Tensor parallel (with sequence parallel) of the built-in GPT, alone and under FSDP, against one process:
real processes on gloo, launched by `dtrain run` as a user launches them."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dtrain.checkpoint import CheckpointStore
from helpers import (
    ROOT,
    TIMEOUT,
    WORKERS,
    assert_weights_close,
    dtrain,
    env,
    eval_lines,
    ok,
    train_lines,
    weights,
)

# Every layout takes global batches of 16 windows: 1 process × 4 × 4 micro-batches; tp2 (one data-parallel
# replica) the same; fsdp2 × tp2 (2 replicas) × 2 micro-batches. Clipping bites (max_grad_norm 0.05).
GPT = [
    "examples/gpt_stdlib.toml",
    "data.block_size=16",
    "data.batch_size=4",
    "training.max_steps=6",
    "training.log_every=1",
    "training.max_grad_norm=0.05",
    "checkpoint.every_steps=3",
    "scheduler.warmup_steps=2",
    "model.options={n_layer = 2, n_head = 4, n_embd = 32}",
    "data.eval_batch_size=16",
]
LAYOUTS = {
    "one": ("1", "training.grad_accum_steps=4"),
    "tp2": ("2", "training.grad_accum_steps=4", "parallel.tp_size=2"),
    "fsdp2_tp2": ("4", "training.grad_accum_steps=2", "parallel.tp_size=2", "parallel.strategy=fsdp"),
    "ddp2": ("2", "training.grad_accum_steps=2"),
    "fsdp4": ("4", "training.grad_accum_steps=1", "parallel.strategy=fsdp"),
    "pp2": ("2", "training.grad_accum_steps=4", "parallel.pp_size=2"),
    # HSDP × TP: 2 replicas of shard groups of 2, each rank's layers split over 2 (8 processes)
    "hsdp2x2_tp2": (
        "8",
        "training.grad_accum_steps=1",
        "parallel.tp_size=2",
        "parallel.strategy=hsdp",
        "parallel.hsdp_shard_size=2",
    ),
}


def launch(tokens, run_dir, layout, *extra, start=dtrain):
    """The job under `layout`; `start` the warm fixture where a test reads what the run wrote."""
    nproc, *settings = LAYOUTS[layout]
    return start("run", *GPT, f"data.path={tokens}", "--nproc", nproc, f"run.dir={run_dir}", *settings, *extra)


@pytest.fixture(scope="module")
def runs(warm, json_byte_tokens, tmp_path_factory):
    """The job uninterrupted on one process, under tp2 and under fsdp2 × tp2 (one launch each)."""
    out = tmp_path_factory.mktemp("tp")
    for layout in ("one", "tp2", "fsdp2_tp2"):
        said = ok(launch(json_byte_tokens, out / layout, layout, start=warm))
        (out / f"{layout}.stderr").write_text(said.stderr)
    return out


def assert_same_training(a, b, tolerance=1e-5):
    losses_a, losses_b = [m["loss"] for m in train_lines(a)], [m["loss"] for m in train_lines(b)]
    assert len(losses_a) == len(losses_b) == 6
    assert losses_a == pytest.approx(losses_b, abs=tolerance), (losses_a, losses_b)
    evals_a, evals_b = [m["eval_loss"] for m in eval_lines(a)], [m["eval_loss"] for m in eval_lines(b)]
    assert len(evals_a) == len(evals_b) >= 1 and evals_a == pytest.approx(evals_b, abs=tolerance)
    # each eval sample counted once, however many processes a replica's model is split over
    assert [m["eval_samples"] for m in eval_lines(a)] == [m["eval_samples"] for m in eval_lines(b)]
    assert_weights_close(weights(a), weights(b), atol=tolerance, rtol=0)


@pytest.mark.parametrize("layout", ["tp2", "fsdp2_tp2"])
def test_tensor_parallel_takes_the_steps_one_process_takes(cli, runs, layout):
    """Per-step losses, eval loss and the final model.safetensors (whole, the tied embedding once) within
    1e-5 of one process, with accumulation and clipping by the global norm over every shard."""
    assert_same_training(runs / "one", runs / layout)
    norms = [m["grad_norm"] for m in train_lines(runs / layout)]
    assert all(n > 0.05 for n in norms)  # clipping bit
    assert norms == pytest.approx([m["grad_norm"] for m in train_lines(runs / "one")], rel=1e-4)
    assert weights(runs / layout)["h.0.attn.c_attn.weight"].shape == (96, 32)  # whole, q/k/v stacked as stored
    # No warning from torch of collectives run one mesh dimension after another: the norm is reduced over
    # the flattened (dp_shard, tp) mesh, and the final gather's warning is kept back.
    assert "While redistributing" not in (runs / f"{layout}.stderr").read_text()
    # Each rank holds its shards: a half under tp2, a quarter under fsdp2 × tp2 (norms, wpe whole).
    held, whole = train_lines(runs / layout)[0]["param_bytes"], train_lines(runs / "one")[0]["param_bytes"][0]
    assert [b / whole for b in held] == pytest.approx([0.5 if layout == "tp2" else 0.25] * len(held), abs=0.02)
    # The whole weights generate as one process's do (greedy: the same continuation).
    greedy = ("--prompt", "{", "--tokens", "20", "--temperature", "0")
    said = ok(cli("generate", str(runs / layout), *greedy)).stdout
    assert said and said == ok(cli("generate", str(runs / "one"), *greedy)).stdout


def test_each_tensor_parallel_rank_draws_dropout_from_a_stream_of_its_own(runs):
    """The GPT's dropout acts on shards under tp (sequence shards, its own heads): the two tp ranks of a
    replica must not draw one mask pattern for different positions. Their generators differ in the
    checkpoint's per-rank RNG files, while the replicas' ranks of one tp coordinate stay alike."""

    def torch_rng(layout, rank):
        folder = CheckpointStore(runs / layout).complete()[-1].path
        return load_file(str(folder / f"rng-rank{rank}.safetensors"))["torch"]

    assert not torch.equal(torch_rng("tp2", 0), torch_rng("tp2", 1))
    # fsdp2 × tp2: ranks (0, 1) and (2, 3) are the replicas, tp innermost
    assert not torch.equal(torch_rng("fsdp2_tp2", 0), torch_rng("fsdp2_tp2", 1))
    assert torch.equal(torch_rng("fsdp2_tp2", 0), torch_rng("fsdp2_tp2", 2))
    assert torch.equal(torch_rng("fsdp2_tp2", 1), torch_rng("fsdp2_tp2", 3))


@pytest.mark.parametrize("layout", ["tp2", "fsdp2_tp2"])
def test_a_tensor_parallel_run_exports_a_whole_hugging_face_model(runs, tmp_path, layout):
    """`dtrain export --format hf` of a tensor-parallel run: a folder transformers loads whole, giving the
    logits of the one-process run's export within 1e-5 (the weights agree within that)."""
    transformers = pytest.importorskip("transformers")  # the test extra installs it
    from dtrain.export.hf import export_hf

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = []
    for name in ("one", layout):
        folder = export_hf(runs / name, tmp_path / name, None, "")
        model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            logits.append(model(ids).logits)
    assert logits[0].shape == logits[1].shape == (2, 16, model.config.vocab_size)
    assert (logits[0] - logits[1]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("layouts", [("tp2", "ddp2", "tp2"), ("fsdp2_tp2", "fsdp4", "hsdp2x2_tp2")])
def test_a_tensor_parallel_checkpoint_resumes_on_another_layout(warm, runs, json_byte_tokens, tmp_path, layouts):
    """Stopped under one layout at step 2, resumed under the next to step 4, then under the last (DCP
    reshards DTensor shards into whole tensors, and whole tensors into shards): tp2 → ddp2 → tp2;
    fsdp2 × tp2 → fsdp4 → HSDP × TP (2 × 2 × 2 processes). The same global samples; the losses, eval
    loss and weights of the run that never stopped."""
    stops = [6 * (k + 1) // len(layouts) for k in range(len(layouts))]  # the last runs to the end (6)
    for k, layout in enumerate(layouts):
        extra = [f"training.stop_at_step={stops[k]}"] if stops[k] < 6 else []
        said = ok(launch(json_byte_tokens, tmp_path, layout, *extra, start=warm)).stderr
        if k:
            assert "resumed from " in said and f"(step {stops[k - 1]} of 6" in said, said
            change = "2 → 1" if "tp2" in layouts[k - 1] else "1 → 2"
            assert f"parallel.tp_size {change}" in said  # the layout's change said
    assert [m["step"] for m in train_lines(tmp_path)] == list(range(1, 7))
    assert_same_training(runs / "one", tmp_path)


@pytest.mark.parametrize(
    "nproc, overrides, message",
    [
        (
            "3",
            ["parallel.tp_size=3"],
            "parallel.tp_size = 3 must divide the GPT's heads (model.options.n_head = 4) and width (n_embd = 32), "
            "each rank holding whole heads; use parallel.tp_size in [1]",  # 2 and 4 fit the heads, not 3 processes
        ),
        (
            "6",
            ["parallel.tp_size=4"],
            "parallel.tp_size = 4 splits the model over 4 processes and the job has 6; run a multiple of 4 "
            "processes (4, 8, 12, 16, ...) or set parallel.tp_size to one of 1, 2 (checkpoints resume under "
            "any layout)",  # 3 and 6 divide the processes, not the 4 heads
        ),
        (
            "12",
            ["parallel.tp_size=5", "parallel.strategy=fsdp"],
            "parallel.tp_size = 5 must divide the GPT's heads (model.options.n_head = 4) and width (n_embd = 32), "
            "each rank holding whole heads; use parallel.tp_size in [1, 2, 4]",  # no world takes 5: the heads first
        ),
        (
            "4",
            ["parallel.tp_size=2"],
            "parallel.strategy = 'ddp' keeps whole copies of the model and parallel.tp_size = 2 splits it "
            "(2 copies over 4 processes): DDP cannot average tensor-parallel shards; set parallel.strategy=fsdp "
            "(or hsdp) to spread the copies",
        ),
        (
            "2",
            ["parallel.tp_size=2", "data.block_size=15"],
            "data.block_size = 15: sequence parallel splits each window's positions evenly over "
            "parallel.tp_size = 2; use a multiple of 2 (14 or 16)",
        ),
        (
            "2",
            ["parallel.tp_size=2", "training.precision=fp16"],
            "training.precision = 'fp16' needs a gradient scaler that knows tensor-parallel shards "
            "(parallel.tp_size = 2); use training.precision=bf16",
        ),
    ],
)
def test_what_tensor_parallel_cannot_do_is_refused_by_the_launcher(
    cli, json_byte_tokens, tmp_path, nproc, overrides, message
):
    result = cli(
        "run", *GPT, f"data.path={json_byte_tokens}", "--nproc", nproc, f"run.dir={tmp_path / 'run'}", *overrides
    )
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [f"dtrain: error: {message}"], result.stderr
    assert not (tmp_path / "run").exists()


def test_a_model_with_no_plan_is_refused_by_the_launcher_saying_how_to_give_one(cli, tmp_path):
    result = cli("run", "examples/digits_mlp.toml", "--nproc", "2", f"run.dir={tmp_path / 'run'}", "parallel.tp_size=2")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "dtrain: error: Sequential has no tensor-parallel plan (parallel.tp_size = 2); give a plan: "
        "dtrain.Trainer(..., tp_plan={'layers.*.up': ColwiseParallel(), ...}) with torch's parallel styles, or a "
        "tp_plan() method on the model returning one; or set parallel.tp_size=1"
    ], result.stderr
    assert not (tmp_path / "run").exists()


TWELVE_STEPS = ("training.max_steps=12", "checkpoint.every_steps=3")


@pytest.fixture(scope="module")
def uninterrupted(warm, json_byte_tokens, tmp_path_factory):
    """The 12-step job run through under a layout (once per layout, on the warm workers): the weights a
    stopped or killed run of that layout must end on when resumed."""
    done: dict[str, Path] = {}

    def of(layout: str) -> Path:
        if layout not in done:
            done[layout] = tmp_path_factory.mktemp(f"whole-{layout}")
            ok(launch(json_byte_tokens, done[layout], layout, *TWELVE_STEPS, start=warm))
        return done[layout]

    return of


def test_a_sigterm_under_tensor_parallel_leaves_a_checkpoint_the_run_resumes_from(
    warm, uninterrupted, json_byte_tokens, tmp_path
):
    """SIGTERM to the launcher mid-run under tp2: one checkpoint, exit 75; the same command resumes from it
    and ends with the weights of the run that was never stopped, bitwise (the same layout)."""
    longer = ("training.max_steps=12", "checkpoint.every_steps=100")  # the SIGTERM's is the one checkpoint
    stopped = tmp_path / "stopped"
    nproc, *settings = LAYOUTS["tp2"]
    args = ["run", *GPT, f"data.path={json_byte_tokens}", "--nproc", nproc, f"run.dir={stopped}", *settings, *longer]
    proc = subprocess.Popen(
        [sys.executable, "-m", "dtrain", *args], cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + TIMEOUT
    while not ((stopped / "metrics.jsonl").exists() and len(train_lines(stopped)) >= 2):
        assert time.monotonic() < deadline and proc.poll() is None, "training did not start"
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)  # as a scheduler would
    _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 75, err
    (checkpoint,) = CheckpointStore(stopped).complete()
    assert 2 <= checkpoint.step < 12 and f"stopped by SIGTERM at step {checkpoint.step}" in err.decode()
    resumed = ok(warm(*args))
    assert f"resumed from {checkpoint.path}" in resumed.stderr
    assert [m["step"] for m in train_lines(stopped)] == list(range(1, 13))
    assert_weights_close(weights(stopped), weights(uninterrupted("tp2")), atol=0, rtol=0)


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_kill_9_of_a_split_model_resumes_from_the_newest_checkpoint(
    warm, uninterrupted, json_byte_tokens, tmp_path, layout
):
    """SIGKILL to the whole job (launcher and workers, nothing can run) once a checkpoint exists, under tp2
    and pp2: the same command resumes from the newest complete checkpoint and ends bitwise on the weights
    of the run that was never stopped (the same layout)."""
    killed = tmp_path / "killed"
    nproc, *settings = LAYOUTS[layout]
    args = [
        *("run", *GPT, f"data.path={json_byte_tokens}", "--nproc", nproc, f"run.dir={killed}"),
        *(*settings, *TWELVE_STEPS),
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "dtrain", *args],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + TIMEOUT
    while not CheckpointStore(killed).complete():
        assert time.monotonic() < deadline and proc.poll() is None, "no checkpoint before the run ended"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=TIMEOUT)
    newest = CheckpointStore(killed).complete()[-1]
    assert newest.step < 12, "the run finished before it was killed"
    resumed = ok(warm(*args))
    assert f"resumed from {newest.path}" in resumed.stderr
    assert [m["step"] for m in train_lines(killed)] == list(range(1, 13))
    assert_weights_close(weights(killed), weights(uninterrupted(layout)), atol=0, rtol=0)


@pytest.fixture(scope="module")
def planned(warm_torchrun, tmp_path_factory):
    """A tiny Hugging Face Llama (its own plan), an MLP (a plan given to the Trainer) and the GPT with a
    wide vocabulary (dtrain's loss, and a user's loss_fn), on 1 process and under tp2: one launch each."""
    out = tmp_path_factory.mktemp("planned")
    for nproc in (1, 2):
        ok(warm_torchrun(WORKERS / "tensor_parallel.py", out, nproc=nproc))
    return out


@pytest.mark.parametrize("name", ["llama", "mlp", "gpt", "gpt_loss_fn"])
def test_a_models_own_plan_and_a_plan_given_to_the_trainer_take_one_process_steps(planned, name):
    """Per-step losses (accumulation, clipping by the global norm: DTensor shards and parameters the plan
    left whole together), eval loss and final weights within 1e-5 of one process."""
    one, tp2 = planned / f"{name}-tp1", planned / f"{name}-tp2"
    losses = [m["loss"] for m in train_lines(tp2)]
    assert len(losses) == 4 and losses == pytest.approx([m["loss"] for m in train_lines(one)], abs=1e-5)
    assert all(m["grad_norm"] > 0.05 for m in train_lines(tp2))  # clipping bit
    assert eval_lines(tp2)[-1]["eval_loss"] == pytest.approx(eval_lines(one)[-1]["eval_loss"], abs=1e-5)
    if name.startswith("gpt"):  # a user's metric over predictions, taking the logits whole
        assert eval_lines(tp2)[-1]["eval_top_logit"] == pytest.approx(eval_lines(one)[-1]["eval_top_logit"], abs=1e-5)
    assert_weights_close(weights(tp2), weights(one), atol=1e-5, rtol=0)
    # Split indeed: each rank holds about half the parameters and optimizer state (norms stay whole).
    held, whole = train_lines(tp2)[0], train_lines(one)[0]
    for key in ("param_bytes", "optimizer_bytes"):
        assert [b / whole[key][0] for b in held[key]] == pytest.approx([0.5, 0.5], abs=0.02), key


def test_dtrains_loss_takes_the_gpts_logits_split_over_the_vocabulary_holding_half(planned):
    """Loss parallel: under tp2 the GPT's logits stay split over the vocabulary for dtrain's cross-entropy,
    so each rank keeps half the bytes of logits (the log-probabilities saved for backward) that it keeps
    when a user's loss_fn takes them gathered whole, as one process does. Both train as one process
    (the test above)."""
    whole = json.loads((planned / "logits-tp1-rank0.json").read_text())
    assert whole["gpt"] == whole["gpt_loss_fn"] == 4 * 16 * 512 * 4  # a micro-batch's fp32 logits
    for rank in (0, 1):
        held = json.loads((planned / f"logits-tp2-rank{rank}.json").read_text())
        assert held == {"gpt": whole["gpt"] // 2, "gpt_loss_fn": whole["gpt"]}, rank


def test_a_gpt_split_over_tensor_parallel_ranks_generates_what_one_process_generates(planned):
    """After fit, the trained GPT still split over tp2 continues an odd-length prompt (sequence parallel
    splits its positions evenly: padded at the end) greedily as the one-process model does."""
    alone = json.loads((planned / "generated-tp1-rank0.json").read_text())
    assert [len(tokens[0]) for tokens in alone.values()] == [9, 9]  # 3 of the prompt and 6 new
    for rank in (0, 1):
        assert json.loads((planned / f"generated-tp2-rank{rank}.json").read_text()) == alone, rank


def test_a_model_given_no_plan_or_an_empty_plan_or_one_naming_no_module_is_refused(planned):
    refusals = json.loads((planned / "refusals-tp2.json").read_text())
    assert refusals["no_plan"].startswith("Sequential has no tensor-parallel plan (parallel.tp_size = 2); give ")
    # A pattern naming no module would leave its layer whole on every rank: refused, naming what is there.
    assert refusals["no_match"] == (
        "the tensor-parallel plan's 'layers.*.up' names no module of Sequential; name modules as "
        "model.named_modules() does (here: 0, 1, 2)"
    )
    assert refusals["empty"].startswith("the tensor-parallel plan given for Sequential is empty; give a plan: ")
