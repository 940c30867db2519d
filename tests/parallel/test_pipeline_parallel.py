"""Pipeline parallel (`parallel.pp_size = 2`): the built-in GPT's 4 blocks over 2 real processes on
gloo, launched by the real CLI, against the same job on one process — per-step losses, eval loss and
final weights within 1e-5 under each schedule, with accumulation (the pipeline's micro-batches) and
clipping (by the norm over both stages); resume across layouts; the bubble; refusals in one line."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtrain.checkpoint import CheckpointStore
from helpers import (
    ROOT,
    TIMEOUT,
    assert_weights_close,
    env,
    eval_lines,
    gpt_on_tokens,
    ok,
    train_lines,
    weights,
)

STEPS, ACCUM = 6, 2
OPTIONS = "model.options={n_layer = 4, n_head = 2, n_embd = 32}"
# Clipping bites on every step (the gradient norm is about 1): the norm over every stage must be right.
SETTINGS = [
    OPTIONS,
    f"training.max_steps={STEPS}",
    f"training.grad_accum_steps={ACCUM}",
    "training.max_grad_norm=0.3",
    "training.eval_every_steps=3",
    "training.eval_batches=3",
    "data.eval_batch_size=4",
    "scheduler.warmup_steps=2",
    "checkpoint.every_steps=3",
]


def job(tokens: Path, run_dir: Path, *args: str, nproc: int = 2, pp: int = 2, batch: int = 4) -> list[str]:
    split = [f"parallel.pp_size={pp}"] if nproc > 1 else []
    return [*gpt_on_tokens(tokens, run_dir, *SETTINGS, *split, *args, block=16, batch=batch), "--nproc", str(nproc)]


@pytest.fixture(scope="module")
def tokens(json_byte_tokens):
    return json_byte_tokens


@pytest.fixture(scope="module")
def one_process(warm, tokens, tmp_path_factory):
    """The job on one process, start to finish: what every layout must reproduce."""
    run_dir = tmp_path_factory.mktemp("pp-one") / "run"
    ok(warm(*job(tokens, run_dir, nproc=1)))
    return run_dir


def assert_same_run(reference: Path, run_dir: Path, first_step: int = 1) -> None:
    want = {m["step"]: m for m in train_lines(reference)}
    got = train_lines(run_dir)
    assert [m["step"] for m in got] == list(range(first_step, STEPS + 1))
    for m in got:
        assert m["loss"] == pytest.approx(want[m["step"]]["loss"], abs=1e-5), m["step"]
        assert m["grad_norm"] == pytest.approx(want[m["step"]]["grad_norm"], rel=1e-5), m["step"]
    evals = {m["step"]: m["eval_loss"] for m in eval_lines(reference)}
    assert {m["step"]: m["eval_loss"] for m in eval_lines(run_dir)} == pytest.approx(
        {s: v for s, v in evals.items() if s >= first_step}, abs=1e-5
    )
    assert_weights_close(weights(reference), weights(run_dir), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "schedule, bubble",
    [("gpipe", 1 / (ACCUM + 1)), ("1f1b", 1 / (ACCUM + 1)), ("interleaved_1f1b", 1 / (2 * ACCUM + 1))],
)
def test_two_stages_train_as_one_process_under_each_schedule(warm, one_process, tokens, tmp_path, schedule, bubble):
    result = ok(warm(*job(tokens, tmp_path, f"parallel.pp_schedule={schedule}")))
    assert_same_run(one_process, tmp_path)
    assert all(m["grad_norm"] > 0.3 for m in train_lines(one_process))  # clipped every step
    # The schedule's idle share, (p−1)/(m+p−1), interleaved (p−1)/(v·m+p−1), on every step line.
    assert [m["pp_bubble"] for m in train_lines(tmp_path)] == [pytest.approx(bubble)] * STEPS
    assert not any("pp_bubble" in m for m in train_lines(one_process))
    assert f"| pipeline bubble {bubble:.0%}" in result.stdout + result.stderr


def test_a_pipeline_checkpoint_resumes_on_one_process_and_back(warm, one_process, tokens, tmp_path):
    """Stopped at step 3 under pp2, resumed on one process (and the other way round): the same run."""
    ok(warm(*job(tokens, tmp_path / "a", "training.stop_at_step=3")))
    resumed = ok(warm(*job(tokens, tmp_path / "a", nproc=1)))
    assert "resumed from" in resumed.stderr
    assert_same_run(one_process, tmp_path / "a")
    ok(warm(*job(tokens, tmp_path / "b", "training.stop_at_step=3", nproc=1)))
    ok(warm(*job(tokens, tmp_path / "b")))
    assert_same_run(one_process, tmp_path / "b")


def test_sigterm_under_pp2_checkpoints_and_the_same_command_resumes_bitwise(warm, tokens, tmp_path):
    """SIGTERM mid-run: one checkpoint, exit 75 (requeue me); the same command resumes and ends with the
    very weights of the run never stopped."""
    long = ["training.max_steps=60", "training.eval_every_steps=0", "checkpoint.every_steps=0"]
    args, run_dir = job(tokens, tmp_path / "stopped", *long), tmp_path / "stopped"
    pipe = subprocess.PIPE
    proc = subprocess.Popen([sys.executable, "-m", "dtrain", *args], cwd=ROOT, env=env(), stdout=pipe, stderr=pipe)
    deadline = time.monotonic() + TIMEOUT
    while not ((run_dir / "metrics.jsonl").exists() and len(train_lines(run_dir)) >= 3):
        assert time.monotonic() < deadline and proc.poll() is None, "training did not start"
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)  # to the launcher, as a scheduler would
    err = proc.communicate(timeout=TIMEOUT)[1].decode()
    assert proc.returncode == 75, err
    (stopped,) = CheckpointStore(run_dir).complete()
    assert 3 <= stopped.step < 60 and f"stopped by SIGTERM at step {stopped.step}" in err
    assert f"resumed from {stopped.path}" in ok(warm(*args)).stderr
    assert [m["step"] for m in train_lines(run_dir)] == list(range(1, 61))
    ok(warm(*job(tokens, tmp_path / "whole", *long)))
    assert_weights_close(weights(tmp_path / "whole"), weights(run_dir), atol=0, rtol=0)


def test_two_pipelines_of_two_stages_train_as_one_process(warm, one_process, tokens, tmp_path):
    """pp 2 × dp 2 (4 processes, each stage replicated over 2), each replica taking half of one process's
    batch: the stages' gradients averaged over their copies."""
    ok(warm(*job(tokens, tmp_path, "parallel.pp_schedule=1f1b", nproc=4, batch=2)))
    assert_same_run(one_process, tmp_path)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_pp2_dp2_tp2_on_8_processes_trains_as_one_process(warm, one_process, tokens, tmp_path, strategy):
    """3-D: pp 2 × dp 2 × tp 2 (8 tiny processes), each replica taking half of one process's batch. Each
    stage's layers split over its 2 tp processes; under ddp the stages are replicated (their gradients
    averaged by the pipeline), under fsdp sharded over the 2 replicas as well (FSDP2 after TP, on one
    mesh). The tied embedding and head are summed shard by shard across the stages, the norm taken over
    stages and shards, the weights gathered whole."""
    ok(warm(*job(tokens, tmp_path, "parallel.tp_size=2", f"parallel.strategy={strategy}", nproc=8, batch=2)))
    assert_same_run(one_process, tmp_path)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["parallel.pp_size=8", "training.grad_accum_steps=8"],
            "parallel.pp_size = 8 makes 8 pipeline stages and the model has 4 blocks; use "
            "parallel.pp_size = 2 or 3 or 4",
        ),
        (
            ["training.grad_accum_steps=1"],
            "training.grad_accum_steps = 1: the pipeline's micro-batches are the accumulation micro-batches "
            "and 2 stages need at least 2; set training.grad_accum_steps >= 2",
        ),
        (
            ["parallel.pp_schedule=1f1b", "parallel.pp_stages_per_rank=2"],
            "parallel.pp_stages_per_rank = 2 needs parallel.pp_schedule = 'interleaved_1f1b' ('1f1b' "
            "runs one stage per process); set it to 1",
        ),
        (
            ["parallel.strategy=fsdp", "parallel.pp_schedule=interleaved_1f1b"],
            "parallel.pp_schedule = 'interleaved_1f1b' holds 2 stages per process, and parallel.strategy "
            "= 'fsdp' shards one stage per process; use parallel.pp_schedule=1f1b (or gpipe), or "
            "parallel.strategy=ddp",
        ),
    ],
)
def test_what_a_pipeline_cannot_run_is_refused_by_the_launcher_in_one_line(cli, tokens, tmp_path, overrides, message):
    pp = 8 if "parallel.pp_size=8" in overrides else 2
    nproc = 2 * pp if "parallel.strategy=fsdp" in overrides else pp  # 2 data-parallel processes to shard over
    result = cli(*job(tokens, tmp_path, *overrides, nproc=nproc, pp=pp))
    assert result.returncode == 2, result.stderr
    assert [line for line in result.stderr.splitlines() if line.strip()] == [f"dtrain: error: {message}"]
    assert not (tmp_path / "metrics.jsonl").exists()


def test_stages_are_cut_by_cost_so_the_stage_with_the_head_takes_fewer_blocks():
    """GPT-2 small (on the meta device): its head multiplies by 768 × 50257 weights, about 5.5 blocks'
    worth, so 2 stages take 9 and 3 blocks (6 and 6 under parallel.pp_split = count); blocks of equal
    cost with free ends split by count, the first stages taking one more; every stage holds a block."""
    import torch

    from dtrain.models.gpt import GPT
    from dtrain.parallel.stages import Layout, cost, stage_sizes

    with torch.device("meta"):
        gpt2 = GPT(50257, 1024, n_layer=12, n_head=12, n_embd=768)
    assert cost(gpt2.h[0]) == 12 * 768 * 768 + 2 * 768  # its linear layers, and the two norms' scales
    assert cost(gpt2.wte) == 0 and cost(gpt2.lm_head) == 768 * 50257  # a lookup; the tied head multiplies
    sizes = [len(blocks) for blocks in Layout(gpt2, "h", 12, 2, 0, 1).blocks_of]
    assert sizes == [9, 3]
    assert [len(blocks) for blocks in Layout(gpt2, "h", 12, 2, 0, 1, by="count").blocks_of] == [6, 6]
    assert stage_sizes([1] * 7, 3) == [3, 2, 2] and stage_sizes([1] * 8, 4) == [2, 2, 2, 2]
    assert stage_sizes([1] * 4, 2, last=10) == [3, 1]  # a head heavier than every block: one block left
    assert stage_sizes([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    assert stage_sizes([0] * 4, 2) == [2, 2] and stage_sizes([0] * 5, 2, last=7) == [3, 2]  # free blocks: by count


@pytest.mark.parametrize("pp, per_rank", [(2, 1), (2, 2), (3, 1)])
def test_stages_keep_the_whole_model_s_names_and_chain_to_its_forward(pp, per_rank):
    """Split in one process: every name of the whole model on exactly the stages that hold it (a tied
    one on both ends), and the stages run one after another compute the whole model's logits."""
    import torch

    from dtrain.models.gpt import GPT
    from dtrain.parallel.stages import Layout, split_model

    torch.manual_seed(0)
    whole = GPT(50, 8, n_layer=4, n_head=2, n_embd=16)
    parts = [split_model(whole, "h", Layout(whole, "h", 4, pp, rank, per_rank)) for rank in range(pp)]
    names = [set(part.state_dict()) for part, _ in parts]
    assert set().union(*names) == set(whole.state_dict())
    assert sum(len(n) for n in names) == len(whole.state_dict())  # each name once: wte first, lm_head last
    assert "wte.weight" in names[0] and "lm_head.weight" in names[-1] and "ln_f.weight" not in names[0]
    views = sorted((stage, view) for rank, (_, vs) in enumerate(parts) for stage, view in zip(
        range(rank, pp * per_rank, pp), vs, strict=True))  # fmt: skip
    x = torch.randint(0, 50, (2, 8))
    with torch.no_grad():
        out = x
        for _, view in views:
            out = view(out)
        torch.testing.assert_close(out, whole(x), rtol=0, atol=0)
