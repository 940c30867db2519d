"""Every way a worker can be started finds the same ranks and takes the same steps."""

import re
import socket
import subprocess
import sys

import pytest

from helpers import (
    ROOT,
    TIMEOUT,
    WAIT_ENV,
    WAIT_EVERY,
    WAIT_TIMEOUT,
    WORKERS,
    assert_waited_then_gave_up,
    assert_weights_close,
    dtrain,
    env,
    fake_mnist,
    ok,
    run,
    side_by_side,
    train_lines,
    weights,
)

JOB = [
    "examples/digits_mlp.toml",
    "data.name=synthetic",
    "data.num_samples=301",
    "data.input_shape=[10]",
    "model.hidden_size=16",
    "training.epochs=1",
    "training.log_every=1",
    "data.batch_size=32",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reference(warm, tmp_path_factory):
    """The job through dtrain's own launcher: what every other start must reproduce."""
    run_dir = tmp_path_factory.mktemp("reference")
    ok(warm("run", *JOB, "--nproc", "2", f"run.dir={run_dir}"))
    return run_dir


def same_run(a, b):
    assert [m["loss"] for m in train_lines(a)] == [m["loss"] for m in train_lines(b)]
    assert_weights_close(weights(a), weights(b), atol=0, rtol=0)


def by_hand(run_dir, per_rank_env, extra=()):
    """Start 2 workers ourselves with the variables a launcher (srun, mpirun, a user) would set."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "dtrain", "run", *JOB, f"run.dir={run_dir}", *extra],
            cwd=ROOT,
            env=env(OMP_NUM_THREADS="1", **per_rank_env(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err


def test_plain_torchrun_module(reference, tmp_path):
    ok(
        run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node=2",
                "-m",
                "dtrain",
                "run",
                *JOB,
                f"run.dir={tmp_path}",
            ],
            extra_env={"OMP_NUM_THREADS": "1"},
        )
    )
    same_run(reference, tmp_path)


def test_srun_style_slurm_variables(reference, tmp_path):
    port = free_port()
    by_hand(
        tmp_path,
        lambda rank: {
            "SLURM_JOB_ID": "77",
            "SLURM_STEP_ID": "0",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURM_NTASKS": "2",
            "SLURM_NODEID": "0",
            "SLURM_STEP_TASKS_PER_NODE": "2",
            "SLURM_STEP_NODELIST": "localhost",
            "MASTER_PORT": str(port),
        },
    )
    same_run(reference, tmp_path)


def test_mpirun_style_open_mpi_variables(reference, tmp_path):
    port = free_port()
    by_hand(
        tmp_path,
        lambda rank: {
            "OMPI_COMM_WORLD_RANK": str(rank),
            "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "MASTER_PORT": str(port),
        },
    )
    same_run(reference, tmp_path)


@pytest.mark.parametrize("scheme", ["tcp", "file"])
def test_tcp_and_file_init_methods(reference, tmp_path, scheme):
    url = f"tcp://127.0.0.1:{free_port()}" if scheme == "tcp" else f"file://{tmp_path / 'rendezvous'}"
    by_hand(
        tmp_path / "run",
        lambda rank: {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"},
        extra=[f"distributed.init_method={url}"],
    )
    same_run(reference, tmp_path / "run")


def test_dtrain_launch_runs_the_guides_example_rewritten(tmp_path):
    fake_mnist(tmp_path / "mnist", n_train=256, n_test=64)
    ok(
        dtrain(
            "launch",
            "--nproc",
            "2",
            "examples/mnist_ddp.py",
            "--data",
            str(tmp_path / "mnist"),
            "--epochs",
            "2",
            "--run-dir",
            str(tmp_path / "run"),
        )
    )
    lines = train_lines(tmp_path / "run")
    assert lines[-1]["step"] == 2 * 2  # 128 samples per rank, batch 64
    assert (tmp_path / "run" / "model.safetensors").is_file()


def test_mnist_config_on_idx_files(tmp_path):
    fake_mnist(tmp_path / "mnist", n_train=512, n_test=128, gz=False)
    ok(
        dtrain(
            "run",
            "examples/mnist_mlp.toml",
            "--nproc",
            "2",
            f"data.path={tmp_path / 'mnist'}",
            "training.epochs=3",
            "optimizer.lr=0.1",
            "training.log_every=2",
            f"run.dir={tmp_path / 'run'}",
        )
    )
    final = [m for m in train_lines(tmp_path / "run")]
    assert final[-1]["loss"] < final[0]["loss"]


def test_launch_flags_launch_even_where_rank_variables_are_set(reference, tmp_path):
    """A Kubernetes PyTorchJob pod sets RANK and WORLD_SIZE for the pod; `--nproc 2` there still
    starts two workers (torchrun gives them their own ranks) and takes the reference's steps."""
    pod = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ok(dtrain("run", *JOB, "--nproc", "2", f"run.dir={tmp_path}", extra_env=pod))
    assert all(len(m["rank_busy_ms"]) == 2 for m in train_lines(tmp_path))
    same_run(reference, tmp_path)


def test_dtrain_launch_in_two_pods_runs_one_job_of_two_ranks(reference, tmp_path):
    """Two pods (RANK 0 and 1 of WORLD_SIZE 2, no launch flags) whose command is `dtrain launch
    script.py`: each runs the script as its pod's worker, and together they take the reference's steps —
    not two jobs of one process each, both writing run.dir."""
    pod = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "dtrain", *POD_COMMANDS["launch"], *JOB, f"run.dir={tmp_path}"],
            cwd=ROOT,
            env=env(OMP_NUM_THREADS="1", RANK=str(rank), **pod),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    errs = [p.communicate(timeout=TIMEOUT)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    assert all(len(m["rank_busy_ms"]) == 2 for m in train_lines(tmp_path))
    same_run(reference, tmp_path)


@pytest.mark.parametrize(
    "variables, message",
    [
        ({"RANK": "5", "WORLD_SIZE": "2"}, "RANK=5 with WORLD_SIZE=2 is impossible: a rank is 0..WORLD_SIZE-1"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "RANK=0 with WORLD_SIZE=0 is impossible"),
        (
            {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"},
            "LOCAL_RANK=3 with LOCAL_WORLD_SIZE=2 and WORLD_SIZE=2 is impossible",
        ),
        (
            {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"},
            "OMPI_COMM_WORLD_RANK=3 with OMPI_COMM_WORLD_SIZE=2 is impossible",
        ),
        (
            {"SLURM_PROCID": "5", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"},
            "SLURM_PROCID=5 with SLURM_NTASKS=2 is impossible",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "99999999999999999999999"},
            "environment variable WORLD_SIZE=99999999999999999999999 is beyond any job's numbers",
        ),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port (1-65535)"),
    ],
)
def test_an_impossible_environment_is_refused_at_once(cli, tmp_path, variables, message):
    result = cli("run", *JOB, f"run.dir={tmp_path / 'run'}", extra_env=variables)
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("dtrain: error: ") and message in lines[0], lines[0]
    assert not (tmp_path / "run").exists()


# A pod's command: `dtrain run CONFIG`, or `dtrain launch` of a user's script that trains the same
# config with the Trainer (its distributed.start waits as `dtrain run`'s worker does).
POD_COMMANDS = {"run": ["run"], "launch": ["launch", str(WORKERS / "config_trainer.py")]}


@pytest.fixture(scope="module")
def waited(tmp_path_factory):
    """The commands of this module that wait for a peer that never comes, started side by side (their
    waits overlap rather than add up): key → (the address or endpoint it waited at, run.dir, exit
    status, its timed lines)."""
    folder = tmp_path_factory.mktemp("waits")
    commands, facts = {}, {}

    def add(key, where, argv, extra_env=None):
        run_dir = folder / "-".join(map(str, key))
        commands[key] = ([*argv, f"run.dir={run_dir}"], {**WAIT_ENV, **(extra_env or {})})
        facts[key] = (where, run_dir)

    def pod(rank, address, port):
        return {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": address, "MASTER_PORT": str(port)}

    for command in POD_COMMANDS:
        for address in ("127.0.0.1", "no-such-host.invalid"):
            port = free_port()
            add(
                ("pod", address, command),
                f"{address}:{port}",
                [sys.executable, "-m", "dtrain", *POD_COMMANDS[command], *JOB]
                + [f"distributed.timeout_s={WAIT_TIMEOUT}", "distributed.hang_timeout_s=0"],
                pod(1, address, port),
            )
        port = free_port()
        add(
            ("rank 0", command),
            f"127.0.0.1:{port}",
            [sys.executable, "-m", "dtrain", *POD_COMMANDS[command], *JOB]
            + [f"distributed.timeout_s={WAIT_TIMEOUT + 3}", "distributed.hang_timeout_s=0"],
            pod(0, "127.0.0.1", port),
        )
    port = free_port()
    add(
        ("trainer",),
        f"127.0.0.1:{port}",
        [sys.executable, str(WORKERS / "config_trainer.py"), *JOB]
        + [f"distributed.timeout_s={WAIT_TIMEOUT}", "distributed.hang_timeout_s=0"],
        pod(1, "127.0.0.1", port),
    )
    for static in (False, True):
        endpoint = f"127.0.0.1:{free_port()}"
        add(
            ("nodes", static),
            endpoint,
            [sys.executable, "-m", "dtrain", "run", *JOB, "--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", endpoint]
            + ["--rdzv-timeout", str(WAIT_TIMEOUT)]
            + (["--node-rank", "0"] if static else []),
        )
    return {key: (*facts[key], *said) for key, said in side_by_side(commands).items()}


@pytest.mark.parametrize("command", ["run", "launch"])
@pytest.mark.parametrize("address", ["127.0.0.1", "no-such-host.invalid"])
def test_a_pod_whose_rank_0_never_answers_waits_visibly_then_gives_up_in_one_line(waited, address, command):
    """RANK=1 of 2 (a Kubernetes pod, srun, mpirun) waits for rank 0's store: it says so 2 s into the
    wait, again at a slow pace, and after distributed.timeout_s gives up in one line — the whole
    output, no C++ warnings, nothing written. So does a pod whose command is `dtrain launch script.py`:
    the script runs as this pod's worker, not as the only worker of a world of its own."""
    address_port, run_dir, code, lines = waited["pod", address, command]
    assert code == 2, lines
    where = re.escape(address_port)
    assert_waited_then_gave_up(
        lines,
        rf"dtrain: waiting for the rendezvous at {where} \(rank 0 serves it; [^)]+\), giving up in "
        r"(?P<left>\d+) s \(distributed\.timeout_s\)",
        rf"dtrain: error: nothing answered at {where} for {WAIT_TIMEOUT} s \(.+\): start rank 0 at that "
        r"address, .*\(MASTER_ADDR and MASTER_PORT set the address, distributed\.timeout_s the wait\)",
    )
    assert not run_dir.exists()


def test_a_trainer_in_a_pod_whose_rank_0_never_answers_says_it_waits_then_raises_one_error(waited):
    """The Python API in a pod (`python script.py` with RANK=1 of 2, no dtrain command): the Trainer's
    start says it waits for rank 0 and gives up with dtrain's error, whose message is the one line —
    not half an hour of silence and torch's C++ frames."""
    address_port, _, code, lines = waited[("trainer",)]
    text = "\n".join(line for _, line in lines)
    assert code == 1 and "frame #" not in text, text
    waits = [line for _, line in lines if line.startswith("dtrain: waiting for the rendezvous")]
    assert len(waits) >= 2 and f"at {address_port} (rank 0 serves it;" in waits[0], text
    assert re.fullmatch(
        rf"dtrain\.errors\.Rank0Missing: nothing answered at {re.escape(address_port)} for {WAIT_TIMEOUT} s .*",
        lines[-1][1],
    ), text


def test_rank_0_whose_master_port_is_taken_says_so_in_one_line(tmp_path):
    """RANK=0 of 2 whose MASTER_PORT something else on the machine listens on cannot serve the store:
    one line naming the address and what to change, exit 2 — not torch's traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = dtrain(
            "run",
            *JOB,
            f"run.dir={tmp_path / 'run'}",
            extra_env={"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
        )
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"dtrain: error: rank 0 could not serve the rendezvous at 127.0.0.1:{port} (")
    assert lines[0].endswith("): give a MASTER_PORT nothing else on this machine uses"), lines[0]


@pytest.mark.parametrize("command", ["run", "launch"])
def test_rank_0_waiting_for_a_rank_that_never_joins_says_so_then_gives_up_in_one_line(waited, command):
    """RANK=0 of 2 with no rank 1 (a pod whose peer is still importing torch, or never started): rank 0
    waits inside init_process_group, says so after a few seconds and at a slow pace, then gives up in
    one line with torch's count — no traceback. The same in a pod running `dtrain launch script.py`."""
    address_port, _, code, lines = waited["rank 0", command]
    assert code == 2, lines
    text = "\n".join(line for _, line in lines)
    *waits, last = [line for _, line in lines]
    found = [
        re.fullmatch(
            rf"dtrain: rank 0: waiting for the other ranks to join at {re.escape(address_port)} \(2 in all\), "
            r"giving up in (\d+) s \(distributed\.timeout_s\)",
            line,
        )
        for line in waits
    ]
    assert len(waits) >= 2 and all(found), text
    # The first line 5 s into the wait (ranks started together meet sooner), then every WAIT_EVERY s.
    left = [int(m[1]) for m in found if m]
    assert left[0] in (WAIT_TIMEOUT - 2, WAIT_TIMEOUT - 3) and all(a - b in (1, 2, 3) for a, b in zip(left, left[1:]))
    assert re.fullmatch(
        rf"dtrain: error: rank 0: the 2 ranks did not meet at {re.escape(address_port)} within {WAIT_TIMEOUT + 3} s "
        r"\(.*1/2 clients joined\): start every rank, or raise distributed\.timeout_s",
        last,
    ), text


@pytest.mark.parametrize("static", [False, True], ids=["c10d", "static"])
def test_a_node_whose_peers_never_come_says_so_then_gives_up_in_one_line(waited, static):
    """The first node of --nnodes 2 serves the rendezvous and nobody joins: 2 s into the wait it says
    what it waits for (under c10d how many nodes; --node-rank 0's store keeps its count out of reach),
    again at a slow pace, and after --rdzv-timeout gives up in one line."""
    endpoint, _, code, lines = waited["nodes", static]
    assert code == 2, lines
    where = re.escape(endpoint)
    what = "the other nodes" if static else "1 more node"
    assert_waited_then_gave_up(
        lines,
        rf"dtrain: waiting for {what} at {where} \(--nnodes 2\), giving up in (?P<left>\d+) s \(--rdzv-timeout\)",
        rf"dtrain: error: not enough nodes joined the rendezvous at {where} within {WAIT_TIMEOUT} s \(--nnodes 2\): "
        r"start the job on the other nodes with the same --rdzv-endpoint, or raise --rdzv-timeout",
    )


def test_static_node_0_says_it_waits_until_node_1_comes_then_no_more():
    """--node-rank 0 of 2 (torchrun's static rendezvous) waits inside its store for node 1: it says so
    2 s in and at a slow pace; node 1 started after that line joins, and once the workers run (they
    say so, then work for a while) nothing more is said about waiting."""
    endpoint = f"127.0.0.1:{free_port()}"

    def node(rank):
        return subprocess.Popen(
            [sys.executable, "-m", "dtrain", "launch", "--nnodes", "2", "--node-rank", str(rank), "--nproc", "1"]
            + ["--rdzv-endpoint", endpoint, str(WORKERS / "slow_start.py"), str(3 * WAIT_EVERY)],
            cwd=ROOT,
            env=env(**WAIT_ENV),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    first = node(0)
    lines = [first.stdout.readline().rstrip("\n")]
    assert re.fullmatch(
        rf"dtrain: waiting for the other nodes at {re.escape(endpoint)} \(--nnodes 2\), giving up in "
        r"(598|597) s \(--rdzv-timeout\)",
        lines[0],
    ), lines
    second = node(1)
    lines += first.communicate(timeout=TIMEOUT)[0].splitlines()
    out_second = second.communicate(timeout=TIMEOUT)[0]
    assert first.returncode == 0 and second.returncode == 0, (lines, out_second)
    started = lines.index("worker started")
    assert all(line.startswith("dtrain: waiting for the other nodes") for line in lines[:started]), lines
    assert lines[started:] == ["worker started"], lines  # three report periods of work: not a word
    assert out_second.splitlines() == ["worker started"], out_second


def test_a_script_failing_on_every_rank_is_reported_once(tmp_path):
    """Under `dtrain launch` a user script that raises everywhere is one traceback with its rank, not
    N interleaved copies; a DtrainError raised in a script is one line with exit status 2."""
    crash = dtrain("launch", "--nproc", "2", str(WORKERS / "failing_script.py"), "crash")
    assert crash.returncode == 1, crash.stderr
    assert crash.stderr.count("Traceback (most recent call last)") == 1, crash.stderr
    rank = re.search(r"^dtrain: error: rank (\d) \(local rank \d\) exited with status 1:$", crash.stderr, re.M)
    assert rank and crash.stderr.count(f"RuntimeError: boom on rank {rank.group(1)}") == 1, crash.stderr
    assert "[rank" not in crash.stderr and "boom on rank" in crash.stderr.splitlines()[-1]
    refuse = dtrain("launch", "--nproc", "2", str(WORKERS / "failing_script.py"), "refuse")
    assert refuse.returncode == 2, refuse.stderr
    assert [line for line in refuse.stderr.splitlines() if line.strip()] == [
        "dtrain: error: data.path = 'nowhere' does not exist; give the folder of the shards"
    ]


@pytest.mark.parametrize("code", [0, 2, 3, 75])
def test_a_worker_ends_like_a_normal_exit(tmp_path, code):
    """Workers leave without the interpreter's teardown (where gloo's threads can abort a finished
    run): a script's own exit status, its atexit handlers and its buffered output all survive that. The
    launcher returns the script's own status — 3 is 3, not 1; 75 reaches the scheduler as a requeue; 2
    (an argparse error) is the script's, not a line of dtrain's — and says which rank ended with it. A
    file the script wrote and never closed is whole, as the interpreter's teardown would leave it."""
    result = dtrain("launch", "--nproc", "2", str(WORKERS / "failing_script.py"), "exit", str(code), str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "atexit-rank0",
        "atexit-rank1",
        "unclosed-rank0",
        "unclosed-rank1",
    ]
    assert [(tmp_path / f"unclosed-rank{rank}").read_text() for rank in (0, 1)] == ["x" * 1000] * 2
    assert "rank 0 is done" in result.stdout and "rank 1 is done" in result.stdout, result.stdout
    assert result.returncode == code, result.stderr
    if code in (2, 3):
        said = rf"dtrain: error: rank \d \(local rank \d\) exited with status {code}"
        assert re.fullmatch(said, result.stderr.strip()), result.stderr


def test_workers_ending_with_different_statuses_return_the_first_failures(tmp_path):
    """Rank 0 exits 3 and rank 1 exits 4 at the same moment: the launcher prints one of them, the first
    it saw, and returns that one's status."""
    result = dtrain("launch", "--nproc", "2", str(WORKERS / "failing_script.py"), "exit", "3,4", str(tmp_path))
    said = re.fullmatch(r"dtrain: error: rank (\d) \(local rank \d\) exited with status (\d)", result.stderr.strip())
    assert said and int(said[2]) == {"0": 3, "1": 4}[said[1]], result.stderr
    assert result.returncode == int(said[2]), result.stderr
