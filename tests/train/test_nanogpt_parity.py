"""A nanoGPT-style run in dtrain next to nanoGPT's own training loop (karpathy/nanoGPT, train.py), and
random-offset windows (data.sampling = random) resuming exactly and differing by rank.

The reference loop is train.py's, written out here as it writes it: its get_batch (random offsets, a
block of block_size + 1 tokens), its get_lr (linear warm-up, cosine decay to min_lr at lr_decay_iters,
then min_lr), model.py's configure_optimizers (decay for dim >= 2, none below, AdamW with betas),
gradient accumulation with the loss divided by the micro-steps, clipping at 1.0. It drives a copy of
the same GPT (dtrain's built-in one, whose architecture is nanoGPT's) from dtrain's initial weights, and
draws its offsets from the generator dtrain's rank 0 draws from (nanoGPT's is torch's global one, seeded
1337 + rank): the same windows. One process, fp32.
"""

import base64
import json
import math
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from random_windows import ACCUM, BATCH, BLOCK, SEED, SIZE, VOCAB, config_for, write_tokens

import dtrain
from dtrain.data.random_windows import window_generator
from dtrain.data.tokens import TokenWindows
from dtrain.models.gpt import GPT
from helpers import SMALL_JOB, WORKERS, ok
from helpers import dtrain as dtrain_cli

# nanoGPT's names for the run's settings.
learning_rate, min_lr, warmup_iters, lr_decay_iters, max_iters = 2e-3, 2e-4, 5, 24, 30
weight_decay, beta1, beta2, grad_clip, gradient_accumulation_steps = 0.1, 0.9, 0.95, 1.0, 2
eval_interval, eval_iters, eval_batch_size = 10, 2, 8


def get_lr(it):
    """nanoGPT's train.py, verbatim."""
    # 1) linear warmup for warmup_iters steps
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    # 2) if it > lr_decay_iters, return min learning rate
    if it > lr_decay_iters:
        return min_lr
    # 3) in between, use cosine decay down to min learning rate
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # coeff ranges 0..1
    return min_lr + coeff * (learning_rate - min_lr)


def configure_optimizers(model, weight_decay, learning_rate, betas):
    """nanoGPT's model.py GPT.configure_optimizers, without its printing and fused check (CPU)."""
    param_dict = {pn: p for pn, p in model.named_parameters()}
    param_dict = {pn: p for pn, p in param_dict.items() if p.requires_grad}
    decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
    nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
    optim_groups = [
        {"params": decay_params, "weight_decay": weight_decay},
        {"params": nodecay_params, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas)


def nanogpt_loop(folder, initial, eval_windows):
    """train.py's loop, one process: the per-step lr, the step's mean micro-batch loss (what dtrain logs;
    train.py prints the last micro-batch's), and the eval loss every eval_interval steps."""
    train_data = np.memmap(folder / "train-00000.bin", dtype=np.uint16, mode="r")
    val_data = np.memmap(folder / "val-00000.bin", dtype=np.uint16, mode="r")
    generator = window_generator(SEED, 0)

    def get_batch(split):
        data = train_data
        ix = torch.randint(len(data) - BLOCK, (BATCH,), generator=generator)
        x = torch.stack([torch.from_numpy((data[i : i + BLOCK]).astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy((data[i + 1 : i + 1 + BLOCK]).astype(np.int64)) for i in ix])
        return x, y

    model = GPT(VOCAB, BLOCK, **SIZE)
    model.load_state_dict(initial)

    def forward(x, y):  # nanoGPT's model computes its loss in forward
        logits = model(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-1)

    @torch.no_grad()
    def estimate_loss():  # over dtrain's fixed held-out windows (see the module's docstring)
        model.eval()
        w = torch.stack(
            [torch.from_numpy(val_data[i * BLOCK : i * BLOCK + BLOCK + 1].astype(np.int64)) for i in eval_windows]
        )
        loss = forward(w[:, :-1], w[:, 1:].contiguous()).item()
        model.train()
        return loss

    optimizer = configure_optimizers(model, weight_decay, learning_rate, (beta1, beta2))
    lrs, losses, evals = [], [], {}
    X, Y = get_batch("train")
    for iter_num in range(max_iters):
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        step_loss = 0.0
        for micro_step in range(gradient_accumulation_steps):  # noqa: B007 (train.py's own words)
            loss = forward(X, Y)
            loss = loss / gradient_accumulation_steps
            X, Y = get_batch("train")
            loss.backward()
            step_loss += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        lrs.append(lr)
        losses.append(step_loss)
        if (iter_num + 1) % eval_interval == 0:  # dtrain evaluates after step N, nanoGPT before iter N
            evals[iter_num + 1] = estimate_loss()
    return lrs, losses, evals


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return write_tokens(tmp_path_factory.mktemp("tokens"))


@pytest.fixture
def one_thread(monkeypatch):
    """Both loops in this process on one thread (OMP_NUM_THREADS tells dtrain to leave it so): on a shared
    machine's cores more threads are slower."""
    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_nanogpt_style_run_takes_nanogpts_own_steps(tokens, tmp_path, one_thread):
    config = dtrain.Config.from_dict(
        {
            "run": {"dir": str(tmp_path / "run"), "seed": SEED},
            "data": {
                "name": "tokens",
                "path": str(tokens),
                "block_size": BLOCK,
                "batch_size": BATCH,
                "eval_batch_size": eval_batch_size,
                "sampling": "random",
            },
            "optimizer": {
                "name": "adamw",
                "lr": learning_rate,
                "weight_decay": weight_decay,
                "betas": [beta1, beta2],
                "no_decay": ["ndim<2"],
            },
            "scheduler": {
                "name": "nanogpt",
                "warmup_steps": warmup_iters,
                "decay_steps": lr_decay_iters,
                "min_lr": min_lr,
            },
            "training": {
                "max_steps": max_iters,
                "grad_accum_steps": gradient_accumulation_steps,
                "max_grad_norm": grad_clip,
                "eval_every_steps": eval_interval,
                "eval_batches": eval_iters,
                "eval_every": 0,
                "log_every": 1,
            },
        }
    )
    torch.manual_seed(0)
    model = GPT(VOCAB, BLOCK, **SIZE)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    train, val = TokenWindows(tokens, "train", BLOCK), TokenWindows(tokens, "val", BLOCK)
    dtrain.Trainer(config, model=model, train_data=train, eval_data=val).fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    ours = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}

    # dtrain's eval_batches cap: eval_iters × eval_batch_size fixed windows, drawn once with run.seed.
    cap = eval_iters * eval_batch_size
    eval_windows = torch.randperm(len(val), generator=torch.Generator().manual_seed(SEED))[:cap].sort().values
    lrs, losses, evals = nanogpt_loop(tokens, initial, eval_windows.tolist())

    assert [r["step"] for r in steps] == list(range(1, max_iters + 1))
    for step, (record, lr, loss) in enumerate(zip(steps, lrs, losses), 1):
        assert abs(record["lr"] - lr) <= 1e-9, f"step {step}: lr {record['lr']} vs nanoGPT's {lr}"
        assert abs(record["loss"] - loss) <= 1e-5, f"step {step}: loss {record['loss']} vs nanoGPT's {loss}"
    assert lrs[0] == learning_rate / (warmup_iters + 1) and lrs[-1] == min_lr  # nanoGPT's warm-up, then its floor
    assert sorted(ours) == sorted(evals) == [10, 20, 30]
    for step in evals:
        assert abs(ours[step] - evals[step]) <= 1e-5, f"eval at step {step}: {ours[step]} vs {evals[step]}"
    assert losses[-1] < losses[0] - 0.5  # it learns


@pytest.fixture(scope="module")
def two_ranks(warm_torchrun, tokens, tmp_path_factory):
    """One launch of 2 processes: an unbroken run, and the same run stopped after step 5 and resumed."""
    out = tmp_path_factory.mktemp("random2")
    ok(warm_torchrun(WORKERS / "random_windows.py", tokens, out, nproc=2))
    return {**json.loads((out / "results.json").read_text()), "out": out}


def test_random_windows_resume_exactly_after_a_stop(two_ranks):
    # The stop's checkpoint keeps each rank's generator where step 6 draws from.
    for rank in range(2):
        kept = json.loads(
            (two_ranks["out"] / "stopped/checkpoints/step-5" / f"data_position-rank{rank}.json").read_text()
        )
        generator = window_generator(SEED, rank)
        for _ in range(5 * ACCUM):
            torch.randint(2, (BATCH,), generator=generator)  # as many draws as 5 steps took
        assert kept["steps"] == 5
        assert base64.b64decode(kept["generator"]) == generator.get_state().numpy().tobytes()
    # and says how it sampled: a resume under data.sampling = windows names the change in its note
    trainer = json.loads((two_ranks["out"] / "stopped/checkpoints/step-5/trainer.json").read_text())
    assert trainer["setup"]["data.sampling"] == "random" and trainer["setup"]["data.packing"] is False
    unbroken_losses, unbroken_seen = two_ranks["unbroken"]
    stopped_losses, stopped_seen = two_ranks["stopped"]
    resumed_losses, resumed_seen = two_ranks["resumed"]
    assert len(unbroken_losses) == 12 and len(stopped_losses) == 5
    # The resumed run's metrics.jsonl holds the stopped run's steps and its own: bitwise, every step.
    assert resumed_losses[:5] == stopped_losses and resumed_losses == unbroken_losses
    for rank in range(2):  # each rank trained exactly the windows it would have
        assert stopped_seen[rank] + resumed_seen[rank] == unbroken_seen[rank]


def test_random_windows_do_not_resume_on_another_number_of_processes(two_ranks, tokens, tmp_path, one_thread):
    """Each process draws its own windows: a checkpoint of 2 cannot continue on 1 (windows in their global
    order can); refused in one line rather than continued from other windows."""
    run_dir = tmp_path / "run"
    shutil.copytree(two_ranks["out"] / "stopped", run_dir)
    model, train = GPT(VOCAB, BLOCK, **SIZE), TokenWindows(tokens, "train", BLOCK)
    with pytest.raises(dtrain.DtrainError) as refused:
        dtrain.Trainer(config_for(tokens, run_dir, steps=20), model=model, train_data=train).fit()
    message = str(refused.value)
    assert "written by 2 processes and this run has 1" in message and "data.sampling=random" in message
    assert "\n" not in message


def test_ranks_draw_different_windows_each_from_its_own_seeded_stream(two_ranks, tokens):
    _, seen = two_ranks["unbroken"]
    data = np.fromfile(tokens / "train-00000.bin", dtype=np.uint16).astype(np.int64)
    for rank in range(2):
        generator = window_generator(SEED, rank)
        drawn = [torch.randint(len(data) - BLOCK, (BATCH,), generator=generator).tolist() for _ in seen[rank]]
        assert seen[rank] == [[data[i : i + BLOCK].tolist() for i in offsets] for offsets in drawn]
    assert all(a != b for a, b in zip(seen[0], seen[1]))  # never the same micro-batch on both ranks


def test_a_bad_data_sampling_is_one_line(tmp_path):
    bad = dtrain_cli("config", "examples/digits_mlp.toml", "data.sampling=shuffled")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0
    assert "data.sampling" in bad.stderr and "windows, random" in bad.stderr
    # Random offsets are token windows': other data is refused before any worker starts, in one line.
    refused = dtrain_cli("run", *SMALL_JOB, "data.sampling=random", f"run.dir={tmp_path / 'run'}")
    assert refused.returncode == 2 and refused.stderr.strip().count("\n") == 0, refused.stderr
    assert "data.sampling = random" in refused.stderr and "data.sampling = windows" in refused.stderr
