"""Bad input gets one clear line, printed once, a non-zero exit, and nothing written."""

import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT, TIMEOUT, dtrain, env, ok, run

CFG = "examples/digits_mlp.toml"


def refused(result, message: str, tmp_path) -> None:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert lines == [f"dtrain: error: {message}"], result.stderr  # one line, once, no traceback
    assert not (tmp_path / "run").exists()  # nothing half-written


@pytest.mark.parametrize(
    "args, message",
    [
        (["trainig.epochs=3"], "unknown key 'trainig.epochs' on the command line; did you mean 'training.epochs'?"),
        (["training.epochs=three"], "training.epochs must be an integer; got 'three' (string)"),
        (["training.grad_accum_steps=0"], "training.grad_accum_steps must be >= 1; got 0"),
        (["data.batch_size=-4"], "data.batch_size must be >= 1; got -4"),
        (
            ["distributed.backend=nccl"],
            "distributed.backend = 'nccl' needs CUDA GPUs and this machine has none; "
            "use distributed.backend=gloo (or auto)",
        ),
        (
            ["--nproc", "2", "data.batch_size=16", "training.global_batch_size=48"],
            "training.global_batch_size = 48 is not a multiple of data.batch_size × processes = 16 × 2 = 32; "
            "give a multiple of 32, or another data.batch_size",
        ),
        (
            ["--nproc", "2", "data.batch_size=16", "training.global_batch_size=64", "training.grad_accum_steps=3"],
            "training.grad_accum_steps = 3 and training.global_batch_size = 64 disagree on 2 process(es) (2 would "
            "make it); give only one of them",
        ),
        (
            ["checkpoint.resume=no", "checkpoint.resume_from=elsewhere"],
            "checkpoint.resume = 'no' starts fresh and --resume-from (checkpoint.resume_from) continues from a "
            "checkpoint: choose one",
        ),
        (
            ["training.device=cuda"],
            "training.device = 'cuda' needs CUDA GPUs and this process sees none; use training.device=auto or cpu",
        ),
        (
            ["training.device=cpu", "distributed.backend=nccl"],
            "distributed.backend = 'nccl' needs CUDA GPUs and training.device = 'cpu'; "
            "use distributed.backend=gloo (or auto)",
        ),
        (
            ["data.name=mnist", "data.path=/no/such/dir"],
            "data.path = '/no/such/dir' does not hold the MNIST IDX files (train-images-idx3-ubyte, "
            "train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, plain or .gz); put them "
            "there or set data.download=true",
        ),
        (
            ["--nproc", "9", "data.name=synthetic", "data.num_samples=10"],
            "data set 'synthetic' has 8 training samples, too few for 9 processes; use --nproc 8 or fewer",
        ),
        (["--nproc", "0"], "--nproc must be >= 1; got 0"),
        (  # an unset shell variable, `--resume-from "$CKPT"`: never a silent fresh start
            ["--resume-from", ""],
            "dtrain run: --resume-from is empty; give a step-N folder or a run.dir (see dtrain run --help)",
        ),
        (["--nproc", "1e3"], "dtrain run: argument --nproc: invalid int value: '1e3' (see dtrain run --help)"),
        (["optimizer.lr=nan"], "optimizer.lr must be a finite number; got nan"),
        (["training.max_grad_norm=inf"], "training.max_grad_norm must be a finite number; got inf"),
        (
            ["training.epochs=99999999999999999999999"],
            "training.epochs = 99999999999999999999999 does not fit in 64 bits; use a smaller value",
        ),
        (["data.batch_size=100000000000"], "data.batch_size must be <= 16777216; got 100000000000"),
        (
            ["data.name=synthetic", "data.input_shape=[3, 4096, 4096]"],
            "data.input_shape = [3, 4096, 4096] × data.num_samples = 60000 is over 2^34 values (64 GiB of float32) "
            "for the synthetic data set; use fewer samples or smaller inputs",
        ),
        (
            ['data.name="digits'],
            'data.name = "digits on the command line: its quotes do not pair up into one string; '
            "write data.name=digits",
        ),
        (
            ["data.input_shape=[1,", "2]"],
            "data.input_shape = [1, on the command line: its '[' is never closed: the shell split it at a space; "
            "quote the whole override, rest and all, e.g. 'data.input_shape=[1, ...]'",
        ),
        (
            ["model.name=gpt"],
            "model.name = 'gpt' takes token ids (integers: data.name=tokens); data.name = 'digits' gives features; "
            "use model.name=mlp",
        ),
        (["model.options.hidden_size=-3"], "model.options.hidden_size must be >= 1; got -3"),
        (
            ["data.name=synthetic", "data.input_shape=[1, 8, 8]", "model.name=cnn", "model.options.channels=0"],
            "model.options.channels must be >= 1; got 0",
        ),
        (
            ["--nnodes", "2"],
            "--nnodes > 1 needs --rdzv-endpoint HOST:PORT (an address of the first node that every node can reach)",
        ),
    ],
)
def test_refused_before_any_worker_starts(cli, tmp_path, args, message):
    refused(cli("run", CFG, *args, f"run.dir={tmp_path / 'run'}"), message, tmp_path)


def test_missing_and_broken_config_files(tmp_path):
    refused(
        dtrain("run", str(tmp_path / "nope.toml"), "--nproc", "2"),
        f"config file {tmp_path / 'nope.toml'} does not exist; pass a TOML file such as examples/digits_mlp.toml",
        tmp_path,
    )
    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\nepochs = \n")
    result = dtrain("run", str(bad), "--nproc", "2")
    assert result.returncode == 2 and result.stderr.startswith(f"dtrain: error: config file {bad} is not valid TOML")
    assert len(result.stderr.strip().splitlines()) == 1
    device = dtrain("run", "/dev/zero")  # read as a config, it would never end
    assert device.returncode == 2 and device.stderr == (
        "dtrain: error: config file /dev/zero is not a regular file; pass a TOML file\n"
    )
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe[training]\n")
    refused(
        dtrain("run", str(binary)), f"config file {binary} is not UTF-8 text (byte 0); TOML files are UTF-8", tmp_path
    )


@pytest.mark.parametrize(
    "model, message",
    [
        ("cnn", "model.name = 'cnn' needs image inputs shaped C×H×W; the data gives [6]; use model.name=mlp"),
        (
            "gpt",
            "model.name = 'gpt' takes token ids (integers: data.name=tokens); data.name = 'user_factories:tiny_data' "
            "gives features; use model.name=mlp",
        ),
    ],
)
def test_a_problem_only_workers_can_see_is_reported_once(tmp_path, model, message):
    # A factory's data set: only the workers, having built it, see that its flat float samples fit neither
    # the cnn (images) nor the gpt (token ids), each of the 2. The launcher prints it once.
    args = ["--nproc", "2", "data.name=user_factories:tiny_data", f"model.name={model}", f"run.dir={tmp_path / 'run'}"]
    refused(dtrain("run", CFG, *args), message, tmp_path)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            [CFG, "model.name=gpt"],
            "model.name = 'gpt' takes token ids (integers: data.name=tokens); data.name = 'digits' gives features; "
            "use model.name=mlp",
        ),
        (
            ["examples/mnist_mlp.toml", "model.name=gpt"],
            "model.name = 'gpt' takes token ids (integers: data.name=tokens); data.name = 'mnist' gives features; "
            "use model.name=mlp",
        ),
        (
            ["examples/gpt_stdlib.toml", "model.name=mlp"],
            "model.name = 'mlp' takes features (floating-point values: digits, mnist, synthetic); data.name = "
            "'tokens' gives token ids; use model.name=gpt",
        ),
        (["examples/gpt_stdlib.toml", "model.options.n_head=0"], "model.options.n_head must be >= 1; got 0"),
    ],
)
def test_dtrain_config_refuses_what_dtrain_run_would(cli, args, message):
    """`dtrain config` answers as `dtrain run` does, without reading data: no token files needed."""
    result = cli("config", *args)
    assert (result.returncode, result.stdout, result.stderr) == (2, "", f"dtrain: error: {message}\n")


@pytest.mark.parametrize(
    "model, message",
    [("cnn", "model.name = 'cnn' needs image inputs"), ("gpt", "model.name = 'gpt' takes token ids")],
)
def test_workers_under_plain_torchrun_print_once_too(tmp_path, model, message):
    result = run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "dtrain",
            "run",
            CFG,
            f"model.name={model}",
            f"run.dir={tmp_path / 'run'}",
        ],
        extra_env={"OMP_NUM_THREADS": "1"},
    )
    assert result.returncode != 0
    assert result.stderr.count(message) == 1, result.stderr
    assert not (tmp_path / "run").exists()


def test_a_crash_is_reported_once_with_its_rank(tmp_path):
    result = dtrain("run", CFG, "--nproc", "2", "data.name=user_factories:explode", f"run.dir={tmp_path / 'run'}")
    assert result.returncode == 1
    assert result.stderr.count("RuntimeError: data factory exploded") == 1
    assert "dtrain: error: rank " in result.stderr


def test_unknown_command_and_missing_script():
    result = dtrain("trian")
    assert result.returncode == 2 and "unknown command 'trian'" in result.stderr
    result = dtrain("launch", "--nproc", "2", "no_such_script.py")
    assert result.returncode == 2 and result.stderr.strip() == "dtrain: error: script no_such_script.py does not exist"


def test_an_empty_run_dir_is_refused(cli, tmp_path):
    """run.dir=$UNSET_VARIABLE: nothing is written anywhere, least of all beside the config."""
    refused(
        cli("run", str(ROOT / CFG), "run.dir=", cwd=tmp_path),
        "run.dir is empty (an unset shell variable?); give the folder the run writes to, e.g. run.dir=runs/first",
        tmp_path,
    )
    assert list(tmp_path.iterdir()) == []


def test_a_run_dir_with_a_nul_character_is_refused(cli, tmp_path):
    """A TOML escape in a quoted override gives a character no path can hold: one line, not a traceback."""
    refused(
        cli("run", str(ROOT / CFG), 'run.dir="a\\u0000b"', cwd=tmp_path),
        "run.dir = 'a\\x00b' holds a NUL character, which no path can; e.g. run.dir=runs/first",
        tmp_path,
    )
    assert list(tmp_path.iterdir()) == []


def test_the_config_being_read_and_a_users_own_file_are_never_overwritten(cli, tmp_path):
    own = tmp_path / "config.toml"
    own.write_text("# my notes\n[training]\nepochs = 1\n")
    own.chmod(0o640)
    before = own.read_bytes()
    refused(
        cli("run", str(own), "run.dir=.", cwd=tmp_path),
        "run.dir = '.' would write the run's config.toml over " + str(own) + ", the config being read; "
        "choose another run.dir (e.g. run.dir=runs/config)",
        tmp_path,
    )
    refused(
        cli("run", CFG, f"run.dir={tmp_path}", "training.epochs=1"),
        f"{own} is not a config dtrain wrote (a file of yours?) and a run writes its config.toml there; "
        f"choose another run.dir, or move the file",
        tmp_path,
    )
    assert own.read_bytes() == before and own.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.toml"]


def test_a_diverged_run_stops_in_one_line_instead_of_training_nans(tmp_path):
    """optimizer.lr=1e30 is a number the config accepts; the loss is nan at the first log step, and the
    run stops there on every rank (exit 2), writing neither a checkpoint nor weights of the broken state.
    (No warm-up: transformers' convention starts it at a learning rate of 0, which would leave step 1 whole.)"""
    result = dtrain(
        "run",
        CFG,
        "optimizer.lr=1e30",
        "scheduler.warmup_steps=0",
        "training.log_every=2",
        "checkpoint.every_steps=2",
        "--nproc",
        "2",
        f"run.dir={tmp_path / 'run'}",
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("dtrain: error: ")]
    assert result.returncode == 2 and errors == [
        "dtrain: error: the training loss became nan by step 2: training diverged and goes no further; try "
        "optimizer.lr=1e+29 or training.max_grad_norm=1.0: rerun with that change and run.overwrite=true to start "
        "afresh"
    ], result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "model.safetensors").exists()
    # Diverging between log steps, with a checkpoint every step: the checkpoint of a step whose update
    # made the weights infinite is refused, not sealed; every sealed one holds finite weights.
    later = tmp_path / "later"
    result = dtrain(
        "run",
        CFG,
        "training.log_every=4",
        "checkpoint.every_steps=1",
        "checkpoint.keep=100",
        "scheduler.warmup_steps=8",
        "optimizer.lr=1e25",
        "--nproc",
        "2",
        f"run.dir={later}",
    )
    assert result.returncode == 2 and "training diverged and goes no further" in result.stderr, result.stderr
    sealed = sorted((later / "checkpoints").glob("step-*"))
    assert sealed and all(finite_weights(folder) for folder in sealed)


def finite_weights(folder) -> bool:
    """Whether a checkpoint's model tensors are all finite (read with torch.distributed.checkpoint)."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader, load

    reader = FileSystemReader(folder / "state")
    items = reader.read_metadata().state_dict_metadata
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in items.items() if k.startswith("model.")}
    load(state, storage_reader=reader, no_dist=True)
    return all(torch.isfinite(t).all() for t in state.values())


def test_outputs_get_the_users_normal_file_mode(tmp_path):
    """Every file and folder dtrain writes (checkpoints, RNG states, the lock, events) gets 0666 / 0777
    less the umask, like any program's; a umask of 002 (group-writable) shows a hard-coded 0644 or 0600."""
    before = os.umask(0o002)
    try:
        ok(
            dtrain(
                "run",
                CFG,
                "training.epochs=1",
                "checkpoint.every_steps=5",
                "--nproc",
                "2",
                f"run.dir={tmp_path / 'run'}",
            )
        )
    finally:
        os.umask(before)
    written = list((tmp_path / "run").rglob("*"))
    assert {p.name for p in written} >= {
        "config.toml",
        "metrics.jsonl",
        "model.safetensors",
        ".lock",
        "trainer.json",
        "rng-rank1.safetensors",
        "COMPLETE.json",
        ".metadata",
    }
    for path in written:
        mode = path.stat().st_mode & 0o777
        assert mode == (0o775 if path.is_dir() else 0o664), f"{path}: {oct(mode)}"


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["data.name=user_factories:returns_a_string"],
            "data.name = 'user_factories:returns_a_string' returned str as its training set; it must return a "
            "map-style Dataset (with __getitem__ and __len__), (train, eval) or {'train': ..., 'eval': ...}",
        ),
        (
            ["model.name=user_factories:no_parameters"],
            "the model (ReLU) has no trainable parameters: there is nothing to train; give a torch.nn.Module with "
            "parameters that require gradients",
        ),
    ],
)
def test_factories_of_the_wrong_kind_are_reported_once_by_the_workers(tmp_path, args, message):
    refused(dtrain("run", CFG, *args, "--nproc", "2", f"run.dir={tmp_path / 'run'}"), message, tmp_path)


def test_a_quoted_run_dir_is_the_folder_between_the_quotes(cli, warm, tmp_path):
    """'run.dir="runs/a"' (quoted twice, as lists must be) trains into runs/a; nothing named '"' appears."""
    config = cli("config", CFG, 'run.dir="runs/a b"', "data.name='digits'")
    assert config.returncode == 0 and 'dir = "runs/a b"' in config.stdout, config.stderr
    ok(warm("run", str(ROOT / CFG), 'run.dir="runs/a"', "training.max_steps=2", "monitor.trackers=[]", cwd=tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["runs"] and (tmp_path / "runs" / "a" / "model.safetensors").exists()


def test_printing_commands_end_quietly_when_their_reader_is_gone(tmp_path):
    """`dtrain config --reference | head`: head leaves after the lines it wanted. The reader here is gone
    before the command writes (the read end closed first), so every write meets a broken pipe: no
    BrokenPipeError traceback, no "Exception ignored" from the interpreter's last flush, exit 0."""
    window = {"step": 5, "epoch": 1, "loss": 1.0, "samples_per_s": 100.0, "step_ms": 10.0, "rank_busy_ms": [8.0]}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(window) + "\n" + json.dumps({**window, "step": 10}) + "\n")
    for args in (["config", "--reference"], ["config", CFG, "training.epochs=3"], ["report", str(tmp_path)]):
        read_end, write_end = os.pipe()
        os.close(read_end)
        with subprocess.Popen(
            [sys.executable, "-m", "dtrain", *args], cwd=ROOT, env=env(), stdout=write_end, stderr=subprocess.PIPE
        ) as proc:
            os.close(write_end)
            stderr = proc.stderr.read().decode() if proc.stderr else ""
            assert proc.wait(timeout=TIMEOUT) == 0 and stderr == "", (args, stderr)
    assert (tmp_path / "report" / "summary.txt").is_file()  # report did its work; only its printing went nowhere
