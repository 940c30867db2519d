"""Token data: `dtrain prepare`, memory-mapped windows in a world-size-independent order, the built-in
GPT (parity with a hand-written nanoGPT-style loop), exact resume, `dtrain generate`, bad input."""

import json
import os
import re
import shutil
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from dtrain.data.prepare import EOT, held_out, load_tokenizer, prepare_text, stdlib_files
from dtrain.data.sampler import GlobalOrderSampler
from dtrain.data.tokens import TokenWindows, read_meta
from dtrain.errors import DtrainError
from dtrain.models.gpt import GPT as GPTModel
from dtrain.rundir.lock import RunDirLock
from helpers import ROOT, WORKERS, assert_weights_close, dtrain, env, metrics, ok, run, train_lines, weights

STDLIB = Path(sysconfig.get_paths()["stdlib"])
GPT = [
    "examples/gpt_stdlib.toml",
    "data.block_size=32",
    "data.batch_size=4",
    "training.epochs=1",
    "training.max_steps=12",
    "training.log_every=1",
    "model.options={n_layer = 2, n_head = 2, n_embd = 32}",
    "scheduler.warmup_steps=2",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Real text nobody here wrote: two packages of the running Python's standard library."""
    folder = tmp_path_factory.mktemp("corpus")
    for package in ("json", "email"):
        shutil.copytree(STDLIB / package, folder / package, ignore=shutil.ignore_patterns("__pycache__"))
    return folder


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("tokens") / "bpe"
    ok(dtrain("prepare", "text", str(corpus), "--out", str(out), "--vocab-size", "1000", "--workers", "2"))
    return out


def split_documents(folder: Path, split: str) -> list[str]:
    meta = read_meta(folder)
    tokenizer = load_tokenizer(folder, meta)
    ids = np.concatenate([np.fromfile(folder / f, dtype=meta["dtype"]) for f in meta["splits"][split]["files"]])
    cuts = np.nonzero(ids == meta["eot_token"])[0]
    assert len(cuts) and cuts[-1] == len(ids) - 1  # every document ends with end-of-text
    return [tokenizer.decode(part.tolist()) for part in np.split(ids[:-1], cuts[:-1] + 1)] if len(ids) else []


@pytest.mark.parametrize("tokenizer", ["bpe", "bytes"])
def test_prepare_round_trips_the_text_and_is_stable(corpus, tmp_path, tokenizer):
    texts = [p.read_text(encoding="utf-8") for p in corpus.rglob("*") if p.is_file()]
    texts = [t for t in texts if t.strip()]  # an empty __init__.py is no document
    outs = [tmp_path / f"out{i}" for i in range(2)]
    for out in outs:
        prepare_text([str(corpus)], str(out), tokenizer=tokenizer, vocab_size=800)
    docs = split_documents(outs[0], "train") + split_documents(outs[0], "val")
    assert len(texts) > 20 and sorted(docs) == sorted(texts)  # decoding the shards gives every file back, once
    assert split_documents(outs[0], "val")  # some held out
    first, second = ([(p.name, p.read_bytes()) for p in sorted(out.iterdir())] for out in outs)
    assert first == second  # the same input, the same bytes (tokenizer included)


def test_prepare_refuses_bad_input_and_leaves_nothing_half_written(cli, corpus, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("  \n")
    (empty / "binary.bin").write_bytes(b"\xff\xfe\x00")
    cases = [
        (
            [str(empty), "--out", str(tmp_path / "a")],
            f"no text in {empty} (2 files, none of them non-empty UTF-8 text); give files or folders of text",
        ),
        ([str(tmp_path / "missing"), "--out", str(tmp_path / "a")], f"{tmp_path / 'missing'}: no such file or folder"),
        (
            [str(corpus), "--out", str(tmp_path / "a"), "--vocab-size", "100"],
            "--vocab-size must be from 257 (the 256 bytes and end-of-text) to 2^31; got 100",
        ),
        (
            [str(corpus), "--out", str(corpus)],
            f"--out {corpus} already exists and is not an empty folder; choose a new one (or delete it to prepare "
            f"again)",
        ),
    ]
    for args, message in cases:
        result = cli("prepare", "text", *args)
        assert result.returncode == 2 and result.stderr.strip() == f"dtrain: error: {message}", result.stderr
    # A vocabulary that does not fit the chosen type.
    from tokenizers import Tokenizer, models

    big = tmp_path / "big.json"
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(70000)}, unk_token="w0")).save(str(big))
    result = cli(
        "prepare", "text", str(corpus), "--out", str(tmp_path / "a"), "--tokenizer", str(big), "--dtype", "uint16"
    )
    assert result.stderr.strip() == (
        "dtrain: error: a vocabulary of 70001 tokens does not fit in uint16 (at most "
        "65536); use --dtype uint32 or a smaller --vocab-size"
    ), result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.json", "empty"]  # no output, no staging folder


def test_one_document_is_trained_on_whatever_its_name(tmp_path):
    """A one-file corpus whose name the hash would hold out is the training split, as any other name's
    is, not refused: which name a user's file has must not decide whether prepare works."""
    name = next(f"doc{i}.txt" for i in range(10_000) if held_out(str(tmp_path / f"doc{i}.txt"), 0.05))
    (tmp_path / name).write_text("one document, the whole corpus\n" * 20)
    meta = prepare_text([str(tmp_path / name)], str(tmp_path / "out"), tokenizer="bytes")
    assert meta["splits"]["train"]["tokens"] > 0 and not meta["splits"].get("val", {}).get("tokens")


def test_a_sigterm_while_prepare_writes_leaves_neither_output_nor_staging_folder(corpus, tmp_path):
    """SIGTERM as the shards are being written (tqdm's lock imports that module then): --out's parent
    holds nothing of this prepare, its staging folder included; exit 75 and one line."""
    out = tmp_path / "out"
    pythonpath = os.pathsep.join([str(WORKERS / "process_faults"), env()["PYTHONPATH"]])
    result = dtrain(
        "prepare",
        "text",
        str(corpus),
        "--out",
        str(out),
        "--tokenizer",
        "bytes",
        extra_env={"SIGTERM_AT_IMPORT": "multiprocessing.synchronize", "PYTHONPATH": pythonpath},
    )
    assert [p.name for p in tmp_path.iterdir()] == [], result.stderr
    assert result.returncode == 75, result.stderr
    assert result.stderr.strip() == (
        f"dtrain: error: stopped by SIGTERM; nothing was written to {out} — rerun the same command to prepare it"
    )


def test_the_standard_library_corpus_is_python_source_without_tests():
    files = stdlib_files()
    assert len(files) > 100 and all(f.suffix == ".py" and f.is_relative_to(STDLIB) for f in files)
    assert STDLIB / "json" / "decoder.py" in files
    assert not any({"test", "site-packages"} & set(f.relative_to(STDLIB).parts) for f in files)


def test_the_order_is_the_same_global_batch_for_1_2_and_4_processes():
    n, global_batch = 1003, 16
    for epoch in range(2):
        batches = {}
        for world in (1, 2, 4):
            per_rank = global_batch // world
            shards = [GlobalOrderSampler(n, r, world, per_rank, seed=7).shard(epoch) for r in range(world)]
            assert len({len(s) for s in shards}) == 1 and len(shards[0]) == (n // global_batch) * per_rank
            # global batch k: each rank's k-th micro-batch, in rank order
            batches[world] = [
                torch.cat([s[k * per_rank : (k + 1) * per_rank] for s in shards]).tolist()
                for k in range(n // global_batch)
            ]
        assert batches[1] == batches[2] == batches[4]
        flat = [i for batch in batches[1] for i in batch]
        assert len(set(flat)) == len(flat)  # no window twice in an epoch
    assert (
        GlobalOrderSampler(n, 0, 2, 8, seed=7).shard(0).tolist()
        != GlobalOrderSampler(n, 0, 2, 8, seed=7).shard(1).tolist()
    )


def test_each_optimizer_step_takes_the_same_samples_when_accumulation_makes_up_for_fewer_processes():
    """data.batch_size fixed at 4, a global batch of 16: 4 processes × 1 micro-batch, 2 × 2 or 1 × 4
    (what a resume on another number of processes does) — every step takes the same 16 samples, and an
    epoch holds the same steps."""
    n, batch, global_batch = 1003, 4, 16
    for epoch in range(2):
        steps = {}
        for world in (1, 2, 4):
            accum = global_batch // (batch * world)
            shards = [GlobalOrderSampler(n, r, world, batch, seed=7, accum=accum).shard(epoch) for r in range(world)]
            per_step = batch * accum
            assert len(shards[0]) == (n // global_batch) * per_step
            steps[world] = [
                sorted(torch.cat([s[k * per_step : (k + 1) * per_step] for s in shards]).tolist())
                for k in range(n // global_batch)
            ]
        assert steps[1] == steps[2] == steps[4]


def test_windows_across_shards_match_the_files(tmp_path):
    parts = [np.arange(0, 100, dtype=np.uint16), np.arange(1000, 1050, dtype=np.uint16)]
    for i, part in enumerate(parts):
        part.tofile(tmp_path / f"train-{i:05d}.bin")
    (tmp_path / "meta.json").write_text(
        json.dumps(
            {
                "format": "dtrain-tokens",
                "version": 1,
                "dtype": "uint16",
                "vocab_size": 2000,
                "tokenizer": "bytes",
                "eot_token": 1999,
                "splits": {"train": {"files": ["train-00000.bin", "train-00001.bin"], "tokens": 150}},
            }
        )
    )
    windows = TokenWindows(tmp_path, "train", block_size=10)
    assert len(windows) == 9 + 4  # (100-1)//10 and (50-1)//10: no window crosses a file
    x, y = windows.take(torch.tensor([0, 8, 9, 12]))
    assert x[0].tolist() == list(range(0, 10)) and y[0].tolist() == list(range(1, 11))
    assert x[1].tolist() == list(range(80, 90)) and y[1].tolist() == list(range(81, 91))
    assert x[2].tolist() == list(range(1000, 1010)) and x[3].tolist() == list(range(1030, 1040))
    assert x.dtype == torch.int64 and windows[12][1].tolist() == list(range(1031, 1041))


def test_a_held_out_split_shorter_than_one_window_is_said_once(pool, tmp_path):
    """20 held-out tokens and data.block_size 32: not one eval window. The run trains (2 processes) and
    says once, at the start, that it does not evaluate and why; no eval line is written."""
    rng = np.random.default_rng(0)
    rng.integers(0, 256, 4000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    rng.integers(0, 256, 20, dtype=np.uint16).tofile(tmp_path / "val.bin")
    splits = {"train": {"files": ["train.bin"], "tokens": 4000}, "val": {"files": ["val.bin"], "tokens": 20}}
    meta = {"format": "dtrain-tokens", "version": 1, "dtype": "uint16", "vocab_size": 256, "eot_token": 0}
    (tmp_path / "meta.json").write_text(json.dumps({**meta, "tokenizer": "bytes", "splits": splits}))
    run_dir = tmp_path / "run"
    result = ok(
        pool.run("run", *GPT, f"data.path={tmp_path}", f"run.dir={run_dir}", "training.max_steps=2", "--nproc", "2")
    )
    notes = [line for line in result.stderr.splitlines() if line.startswith("note:")]
    assert notes == [
        f"note: data.path = '{tmp_path}' holds 20 held-out tokens and not one window of data.block_size + 1 = 33 "
        f"tokens in a file: this run does not evaluate; lower data.block_size, or prepare more held-out text "
        f"(--val-fraction)"
    ]
    # Training lines, and the checkpoint records every checkpoint writes: no eval record, empty or not.
    assert train_lines(run_dir) and not [m for m in metrics(run_dir) if any(key.startswith("eval") for key in m)]


def test_memory_stays_flat_on_a_token_file_much_larger_than_a_batch(tmp_path):
    """64 MB of tokens, 3 000 batches drawn from all over it: the process's own (anonymous) memory does
    not grow with what it has read; only the page cache does."""
    np.random.default_rng(0).integers(0, 50000, 32_000_000, dtype=np.uint16).tofile(tmp_path / "train-00000.bin")
    (tmp_path / "meta.json").write_text(
        json.dumps(
            {
                "format": "dtrain-tokens",
                "version": 1,
                "dtype": "uint16",
                "vocab_size": 50000,
                "tokenizer": "bytes",
                "eot_token": 0,
                "splits": {"train": {"files": ["train-00000.bin"], "tokens": 32_000_000}},
            }
        )
    )
    windows = TokenWindows(tmp_path, "train", block_size=256)
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(0))

    def anonymous_kib() -> int:
        status = Path("/proc/self/status").read_text()
        return int(re.search(r"RssAnon:\s+(\d+) kB", status).group(1))

    windows.take(order[:8])
    before = anonymous_kib()
    for k in range(3000):
        windows.take(order[k * 8 : (k + 1) * 8])
    assert anonymous_kib() - before < 16 * 1024, "memory grew with the data read"


def test_meta_json_problems_are_one_line(prepared, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(prepared, folder)
    meta = json.loads((folder / "meta.json").read_text())
    cases = [
        (lambda: (folder / "meta.json").write_text("{not json"), "is not readable JSON"),
        (
            lambda: (folder / "meta.json").write_text(json.dumps({**meta, "format": "other"})),
            "'format' must be \"dtrain-tokens\"",
        ),
        (
            lambda: (folder / "meta.json").write_text(json.dumps({**meta, "vocab_size": 70000})),
            "'vocab_size' must be an integer from 2 to what uint16 holds; got 70000",
        ),
        (lambda: (folder / "train-00000.bin").unlink(), "train-00000.bin is missing"),
    ]
    for damage, message in cases:
        (folder / "meta.json").write_text(json.dumps(meta))
        if not (folder / "train-00000.bin").exists():
            shutil.copy(prepared / "train-00000.bin", folder)
        damage()
        with pytest.raises(DtrainError, match=re.escape(message)) as refused:
            read_meta(folder)
        assert "\n" not in str(refused.value)
    shutil.rmtree(folder)
    with pytest.raises(DtrainError, match="meta.json does not exist: data.path must be a folder made by"):
        read_meta(folder)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["data.path=/no/such/tokens"],
            "/no/such/tokens/meta.json does not exist: data.path must be a folder made by "
            "`dtrain prepare text ... --out /no/such/tokens`",
        ),
        (
            ["data.block_size=1000000"],
            "holds 0 training windows of data.block_size + 1 = 1000001 tokens, fewer than "
            "one global batch (8 = data.batch_size × 2 processes); lower data.block_size or "
            "data.batch_size, or prepare more text",
        ),
        (
            ["model.options={n_layer = 1, n_head = 1, n_embd = 8, vocab_size = 50}"],
            "model.options.vocab_size = 50 is smaller than the data's vocabulary (1000 tokens, meta.json); drop it to "
            "use the data's",
        ),
        (
            ["model.options={n_layer = 1, n_head = 1, n_embd = 8, block_size = 16}"],
            "model.options.block_size = 16 is shorter than data.block_size = 32; raise it or lower data.block_size",
        ),
        (
            ["model.name=mlp"],
            "model.name = 'mlp' takes features (floating-point values: digits, mnist, synthetic); data.name = "
            "'tokens' gives token ids; use model.name=gpt",
        ),
        (["model.options.n_embd=33"], "model.options.n_embd = 33 must be a multiple of n_head = 2"),
    ],
)
def test_token_jobs_that_cannot_work_are_refused_in_one_line(cli, prepared, tmp_path, args, message):
    result = cli("run", *GPT, f"data.path={prepared}", *args, "--nproc", "2", f"run.dir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("dtrain: error: ") and message in lines[0], result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["model.name=mlp"],
            "model.name = 'mlp' takes features (floating-point values: digits, mnist, synthetic); data.name = "
            "'tokens' gives token ids; use model.name=gpt",
        ),
        (["model.name=cnn"], "model.name = 'cnn' takes features (floating-point values"),
        (["model.options.n_embd=33"], "model.options.n_embd = 33 must be a multiple of n_head = 2"),
        (["model.options.block_size=16"], "model.options.block_size = 16 is shorter than data.block_size = 32"),
        (["model.options.vocab_size=50"], "model.options.vocab_size = 50 is smaller than the data's vocabulary"),
        (["model.options.n_layers=2"], "model.options has n_layers, which gpt() does not take; it takes n_layer,"),
    ],
)
def test_a_model_that_cannot_train_on_the_data_is_refused_by_the_launcher(prepared, tmp_path, args, message):
    """The launcher's own checks (no worker started) refuse, in one line, a built-in model for samples of
    another kind, and GPT options that cannot build for this data (it builds the model on the meta device)."""
    from dtrain.config import load_config
    from dtrain.launch.preflight import preflight

    overrides = [*GPT[1:], f"data.path={prepared}", f"run.dir={tmp_path / 'run'}", *args]
    config = load_config(ROOT / GPT[0], overrides)
    with pytest.raises(DtrainError) as refused:
        preflight(config, world_size=2, local_world_size=2)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "run").exists()


def test_the_built_in_gpt_equals_a_hand_written_nanogpt_loop(warm_torchrun, prepared, tmp_path):
    ok(warm_torchrun(WORKERS / "gpt_parity.py", prepared, tmp_path))
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results["dtrain"]) == len(results["hand"]) == 12
    for step, (ours, theirs) in enumerate(zip(results["dtrain"], results["hand"]), 1):
        assert abs(ours - theirs) <= 1e-6, f"step {step}: {ours} vs {theirs}"
    assert results["hand"][-1] < results["hand"][0] - 0.2  # it learns


@pytest.fixture(scope="module")
def gpt_run(pool, prepared, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("gpt_run")
    ok(pool.run("run", *GPT, f"data.path={prepared}", "--nproc", "2", f"run.dir={run_dir}"))
    return run_dir


def test_a_gpt_run_logs_tokens_per_s_and_perplexity_and_resumes_exactly(pool, prepared, gpt_run, tmp_path):
    lines = train_lines(gpt_run)
    assert all(line["tokens_per_s"] == pytest.approx(line["samples_per_s"] * 32) for line in lines)
    assert lines[-1]["loss"] < lines[0]["loss"]
    final = [json.loads(line) for line in (gpt_run / "metrics.jsonl").read_text().splitlines()][-1]
    assert final["eval_perplexity"] == pytest.approx(np.exp(final["eval_loss"]))
    # Stopped mid-epoch at step 5, resumed: bitwise the same weights as the run that never stopped.
    ok(pool.run("run", *GPT, f"data.path={prepared}", "--nproc", "2", f"run.dir={tmp_path}", "training.stop_at_step=5"))
    resumed = ok(pool.run("run", *GPT, f"data.path={prepared}", "--nproc", "2", f"run.dir={tmp_path}"))
    assert re.search(r"^resumed from \S+/checkpoints/step-5 \(step 5 of 12, epoch 1 of 1\)$", resumed.stderr, re.M)
    a, b = weights(gpt_run), weights(tmp_path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_generate_prints_a_sample_decoded_with_the_runs_tokenizer(cli, gpt_run, tmp_path):
    first = ok(dtrain("generate", str(gpt_run), "--prompt", "def ", "--tokens", "30")).stdout
    again = ok(cli("generate", str(gpt_run), "--prompt", "def ", "--tokens", "30")).stdout
    assert first.startswith("def ") and len(first) > len("def ") + 10 and first == again  # seeded
    assert EOT not in first
    assert (gpt_run / "tokenizer" / "tokenizer.json").is_file()  # kept beside the weights
    moved = tmp_path / "moved"
    shutil.copytree(gpt_run, moved)
    config = (moved / "config.toml").read_text()
    (moved / "config.toml").write_text(re.sub(r'(?m)^path = ".*"$', 'path = "/gone/tokens"', config))
    elsewhere = ok(cli("generate", str(moved), "--prompt", "def ", "--tokens", "30", cwd=tmp_path)).stdout
    assert elsewhere == first  # the data folder gone, the run read from another folder: the same sample
    # A run still training there (it holds run.dir's lock, as a resumed run does): the sample is said to
    # be from its last finish's weights, and without weights yet generate says what it waits for.
    for folder in (gpt_run, moved):
        lock = RunDirLock(folder)
        lock.acquire()
        try:
            busy = ok(cli("generate", str(folder), "--prompt", "def ", "--tokens", "30"))
            assert busy.stdout == first and busy.stderr.strip() == (
                f"note: {folder} is still training; this sample is from the model.safetensors of its last finish"
            )
            if folder == moved:
                (moved / "model.safetensors").unlink()
                shutil.rmtree(moved / "checkpoints")
                waiting = cli("generate", str(moved))
                assert waiting.returncode == 2 and waiting.stderr.strip() == (
                    f"dtrain: error: {moved} is still training and has written neither a checkpoint nor "
                    f"model.safetensors yet; generate once it has (checkpoint.every_steps sets how often it "
                    f"checkpoints)"
                )
        finally:
            lock.release()
    for flags in (["--temperature", "nan"], ["--tokens", "1000000"]):
        refused = cli("generate", str(gpt_run), *flags)
        assert refused.returncode == 2 and refused.stderr.startswith("dtrain: error: --temperature must be a number")
    result = cli("generate", str(gpt_run / "nope"))
    assert result.returncode == 2 and "model.safetensors does not exist" not in result.stderr
    assert result.stderr.strip() == (
        f"dtrain: error: {gpt_run / 'nope' / 'config.toml'} does not exist: RUN_DIR must be the run.dir of a dtrain run"
    )


def test_temperature_0_takes_the_likeliest_token_whatever_the_seed(cli, gpt_run):
    """Greedy decoding: each new token the argmax of the model's next-token scores, so the sample does not
    depend on --seed (at the default temperature it does)."""
    torch.manual_seed(0)
    model = GPTModel(vocab_size=50, block_size=8, n_layer=1, n_head=2, n_embd=16).eval()
    prompt = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        greedy = [model.generate(prompt, 12, 0, generator=torch.Generator().manual_seed(s)) for s in (0, 1)]
        expected = prompt
        for _ in range(12):  # argmax by hand, over the last block_size tokens as generate reads them
            expected = torch.cat([expected, model(expected[:, -8:])[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(greedy[0], expected) and torch.equal(greedy[1], expected)
    samples = {
        (t, s): ok(
            cli("generate", str(gpt_run), "--prompt", "def", "--tokens", "20", "--temperature", t, "--seed", s)
        ).stdout
        for t in ("0", "1")
        for s in ("0", "1")
    }
    assert samples["0", "0"] == samples["0", "1"] and samples["1", "0"] != samples["1", "1"]


def test_generate_samples_the_newest_checkpoint_of_a_run_not_finished(cli, pool, prepared, gpt_run, tmp_path):
    """A run trained on from step 12 to 16 (its checkpoint step-16 sealed after the step-12 weights it
    started from): generate samples step 16's weights, says so, and gives the text those weights give
    once they are the run's model.safetensors."""
    run_dir = tmp_path / "run"
    shutil.copytree(gpt_run, run_dir)
    more = [*GPT, f"data.path={prepared}", f"run.dir={run_dir}", "training.max_steps=16", "optimizer.lr=0.1"]
    ok(pool.run("run", *more, "--nproc", "2"))
    sample = ["--prompt", "def", "--tokens", "40", "--temperature", "1", "--top-k", "0"]  # seeded: one text per state
    at_12, at_16 = (ok(cli("generate", str(d), *sample)).stdout for d in (gpt_run, run_dir))
    assert at_12 != at_16  # four steps at a high rate changed the sample: the test tells the states apart
    shutil.copy2(gpt_run / "model.safetensors", run_dir / "model.safetensors")  # step 12's, older than step-16
    lock = RunDirLock(run_dir)
    for training in (False, True):
        if training:  # the run still going (it holds run.dir's lock), and no final weights yet
            lock.acquire()
            (run_dir / "model.safetensors").unlink()
        try:
            result = ok(cli("generate", str(run_dir), *sample))
        finally:
            if training:
                lock.release()
        why = "is still training" if training else "has a checkpoint newer than its model.safetensors"
        assert result.stdout == at_16 and result.stderr.strip() == (
            f"note: {run_dir} {why}; this sample is from its newest checkpoint, step-16 (step 16)"
        )
    stopped = ok(cli("generate", str(run_dir), *sample))  # lock released: a run that stopped before its end
    assert stopped.stdout == at_16 and "has no model.safetensors; this sample is from" in stopped.stderr


def test_a_hugging_face_causal_lm_trains_on_dict_batches_and_resumes_exactly(prepared, tmp_path):
    """examples/hf_causal_lm.py through `dtrain launch`: dict samples, the model's own .loss, 2 ranks."""
    pytest.importorskip("transformers")  # the test extra installs it
    launch = [
        "launch",
        "--nproc",
        "2",
        "examples/hf_causal_lm.py",
        "--data",
        str(prepared),
        "--width",
        "32",
        "--layers",
        "1",
    ]
    plan = [
        "data.block_size=32",
        "data.batch_size=4",
        "training.max_steps=10",
        "training.log_every=1",
        "scheduler.warmup_steps=2",
        "optimizer.lr=0.003",
    ]
    whole = tmp_path / "whole"
    said = ok(dtrain(*launch, "--run-dir", str(whole), *plan)).stderr.splitlines()
    hf_warnings = [line for line in said if line.startswith("[transformers]")]
    assert len(hf_warnings) == len(set(hf_warnings)), said  # rank 0's, not one copy per rank
    lines = train_lines(whole)
    assert len(lines) == 10 and lines[-1]["loss"] < lines[0]["loss"] - 0.1  # it learns
    assert lines[0]["tokens_per_s"] == pytest.approx(lines[0]["samples_per_s"] * 32)
    records = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    final = [record for record in records if "eval_loss" in record][-1]  # the end's checkpoint record follows it
    assert final["step"] == 10 and "eval_accuracy" not in final
    assert final["eval_perplexity"] == pytest.approx(np.exp(final["eval_loss"]))
    parted = tmp_path / "parted"
    ok(dtrain(*launch, "--run-dir", str(parted), *plan, "training.stop_at_step=4"))
    resumed = ok(dtrain(*launch, "--run-dir", str(parted), *plan))
    assert re.search(r"^resumed from \S+/checkpoints/step-4 \(step 4 of 10, epoch 1 of \d+\)$", resumed.stderr, re.M)
    a, b = weights(whole), weights(parted)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # With selective activation checkpointing the model's key/value cache, which its forward appends
    # to, must be off, or the recomputation in backward fails; then it takes the same steps (within
    # rounding: some outputs are recomputed rather than kept).
    recomputed = tmp_path / "selective"
    ok(dtrain(*launch, "--run-dir", str(recomputed), *plan, "training.activation_checkpointing=selective"))
    assert [m["loss"] for m in train_lines(recomputed)] == pytest.approx([m["loss"] for m in lines], abs=1e-5)
    assert_weights_close(weights(recomputed), a, atol=1e-5, rtol=0)


def test_prepare_never_reads_its_own_earlier_output_as_text(corpus, tmp_path):
    source = tmp_path / "src"
    shutil.copytree(corpus, source)
    first = prepare_text([str(source)], str(source / "out"), tokenizer="bytes")  # --out inside the source
    second = prepare_text([str(source)], str(tmp_path / "again"), tokenizer="bytes")
    assert second["source"]["documents"] == first["source"]["documents"]
    assert second["splits"]["train"]["tokens"] == first["splits"]["train"]["tokens"]


def test_prepare_reads_a_file_once_whatever_links_lead_to_it(corpus, tmp_path):
    """A symlink to a file is the same document (else one text could be both trained on and held out), a
    symlink loop (to `..`) repeats nothing, through a folder or a `**` glob, and a dangling link is no match."""
    source = tmp_path / "src"
    shutil.copytree(corpus, source)
    (source / "json" / "decoder_again.py").symlink_to("decoder.py")
    (source / "json" / "up").symlink_to("..")
    (source / "json" / "dangling.py").symlink_to("nowhere.py")
    plain = prepare_text([str(corpus)], str(tmp_path / "plain"), tokenizer="bytes")["source"]
    for sources in ([str(source)], [f"{source}/**"], [f"{source}/json/*.py", str(source)]):
        meta = prepare_text(sources, str(tmp_path / f"out{len(sources)}{sources[0][-1]}"), tokenizer="bytes")
        assert (meta["source"]["files"], meta["source"]["documents"]) == (plain["files"], plain["documents"]), sources
    result = dtrain("prepare", "text", f"{source}/json/dangling*", "--out", str(tmp_path / "none"))
    assert result.returncode == 2
    assert result.stderr.strip() == f"dtrain: error: {source}/json/dangling*: matches no file or folder"


def test_token_ids_outside_the_vocabulary_are_one_line(prepared, tmp_path):
    folder = tmp_path / "oov"
    shutil.copytree(prepared, folder)
    ids = np.fromfile(folder / "train-00000.bin", dtype=np.uint16)
    ids[::50] = 65535
    ids.tofile(folder / "train-00000.bin")
    with pytest.raises(
        DtrainError, match="a token id 65535 is outside the vocabulary \\(vocab_size 1000 in meta.json\\)"
    ) as refused:
        TokenWindows(folder, "train", 32).take(torch.arange(40))
    assert "\n" not in str(refused.value)
    # Through the CLI: found by the workers in the first batch, said once, and nothing left half-written,
    # so the rerun on repaired data starts as the first would.
    run_dir = tmp_path / "run"
    args = ["run", *GPT, "training.max_steps=2", f"data.path={folder}", "--nproc", "2", f"run.dir={run_dir}"]
    failed = dtrain(*args)
    assert failed.returncode == 2 and [line for line in failed.stderr.splitlines() if line.strip()] == [
        f"dtrain: error: {refused.value!s}"
    ], failed.stderr
    assert [p.name for p in run_dir.iterdir()] == [".lock"]
    shutil.copy(prepared / "train-00000.bin", folder / "train-00000.bin")
    ok(dtrain(*args))
    assert [m["step"] for m in train_lines(run_dir)] == [1, 2]


def peak_rss_mib(*args: str) -> float:
    """The peak resident memory of `dtrain ARGS`, measured by a parent that runs only it."""
    parent = (
        "import resource, subprocess, sys; done = subprocess.run(sys.argv[1:]); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(done.returncode)"
    )
    result = ok(run([sys.executable, "-c", parent, sys.executable, "-m", "dtrain", *args]))
    return int(result.stdout.split()[-1]) / 1024  # KiB on Linux


def test_prepare_memory_does_not_grow_with_the_corpus(tmp_path):
    """48 MB of text — 32 files and one 16 MB line — prepared in no more memory than one small file: text
    is read, encoded and written a piece at a time (all in memory took ~20× the corpus)."""
    words = [f"w{i}" for i in range(997)]
    block = " ".join(words[(i * 7919) % 997] for i in range(200_000))[: 1 << 20]  # 1 MiB of words
    big = tmp_path / "big"
    big.mkdir()
    for i in range(32):
        (big / f"doc{i:02d}.txt").write_text(f"document {i}\n{block}\n")
    (big / "one-line.txt").write_text(block * 16)
    small = tmp_path / "small"
    small.mkdir()
    (small / "doc.txt").write_text(block[:1000])
    corpus_mib = sum(p.stat().st_size for p in big.iterdir()) / 2**20
    baseline = peak_rss_mib("prepare", "text", str(small), "--out", str(tmp_path / "small-out"), "--tokenizer", "bytes")
    peak = peak_rss_mib("prepare", "text", str(big), "--out", str(tmp_path / "out"), "--tokenizer", "bytes")
    assert peak - baseline < corpus_mib / 2, f"{peak - baseline:.0f} MiB more for {corpus_mib:.0f} MiB of text"
    meta = read_meta(tmp_path / "out")
    tokens = sum(split["tokens"] for split in meta["splits"].values())
    assert tokens == sum(p.stat().st_size + 1 for p in big.iterdir())  # every byte, and an end-of-text each


def test_long_texts_are_cut_where_their_tokens_are_cut_anyway(corpus, tmp_path, monkeypatch):
    """Texts longer than a piece are trained on and encoded in pieces: the tokenizer and every document's
    tokens are what the whole texts give (pieces of a few hundred characters here, to cut often)."""
    import dtrain.data.text_shards as text_shards

    source = tmp_path / "src"
    shutil.copytree(corpus / "json", source)
    long_text = (STDLIB / "json" / "decoder.py").read_text(encoding="utf-8")
    (source / "crlf.txt").write_bytes(long_text.replace("\n", "\r\n").encode())  # newlines as read_text gives
    (source / "one-line.txt").write_text(" ".join(long_text.split()) + "   \t  x\n\n  y")
    files = sorted(p for p in source.iterdir() if p.is_file() and p.read_text().strip())
    for path in files:
        pieces = list(text_shards.read_pieces(path, 300))
        assert "".join(pieces) == path.read_text() and max(map(len, pieces)) <= 300
    assert len(list(text_shards.read_pieces(source / "one-line.txt", 300))) > 20

    whole = text_shards.train_bpe(files, 800)  # the default pieces are longer than any of these texts
    monkeypatch.setattr(text_shards, "TRAIN_PIECE", 300)
    monkeypatch.setattr(text_shards, "ENCODE_PIECE", 500)
    monkeypatch.setattr(text_shards, "BATCH_CHARS", 2000)
    assert text_shards.train_bpe(files, 800).to_str() == whole.to_str()
    meta = prepare_text([str(source)], str(tmp_path / "out"), vocab_size=800, val_fraction=0)
    tokenizer = load_tokenizer(tmp_path / "out", meta)
    assert tokenizer.to_str() == whole.to_str()
    ids = np.fromfile(tmp_path / "out" / "train-00000.bin", dtype=meta["dtype"]).tolist()
    assert ids == [i for path in files for i in [*tokenizer.encode(path.read_text()).ids, meta["eot_token"]]]


def test_prepare_forks_no_process(corpus, tmp_path):
    """No fork of a process whose other threads (torch's, the BPE trainer's) may hold a lock at that
    moment — what a forked encoding pool did, the class of fork-after-threads deadlock; nor its workers'
    stray 'stopped by SIGTERM' line (dtrain's handler, inherited) when the pool ended them."""
    script = (
        "import os, sys; from dtrain.cli import main; forks = []; os.register_at_fork(before=lambda: forks.append(1)); "
        "status = main(sys.argv[1:]); print('forks:', len(forks)); sys.exit(status)"
    )
    args = ["prepare", "text", str(corpus), "--out", str(tmp_path / "out"), "--vocab-size", "800", "--workers", "2"]
    result = ok(run([sys.executable, "-c", script, *args]))
    assert result.stdout.splitlines()[-1] == "forks: 0"
    assert "SIGTERM" not in result.stderr, result.stderr
