"""Two nodes for real: each its own network namespace and address, joined by a veth pair, one job
through torchrun's c10d rendezvous. Skipped where namespaces cannot be made (needs root and iproute2)."""

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

from helpers import (
    ROOT,
    TIMEOUT,
    WAIT_ENV,
    WAIT_EVERY,
    WAIT_TIMEOUT,
    WORKERS,
    assert_waited_then_gave_up,
    env,
    ok,
    run,
    side_by_side,
    weights,
)

JOB = [
    "examples/digits_mlp.toml",
    "data.name=synthetic",
    "data.num_samples=500",
    "data.input_shape=[12]",
    "data.num_classes=3",
    "data.batch_size=16",
    "model.name=faults:dying_mlp",
    "training.epochs=2",
    "training.log_every=1",
]
SUBNET = "10.213.{}.{}"
# torch's c10d warns once that the peer address of the rendezvous store's own client has no name: these
# test namespaces have no reverse DNS.
TORCH_REVERSE_LOOKUP = "The hostname of the client socket cannot be retrieved"


def without_reverse_lookup(output: str) -> list[str]:
    return [line for line in output.splitlines() if TORCH_REVERSE_LOOKUP not in line]


def ip(*args):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True)


@pytest.fixture(scope="module")
def nodes():
    """Two namespaces, node0 at 10.213.N.1 and node1 at 10.213.N.2; removed afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("making network namespaces needs root and the ip command (iproute2)")
    tag = f"{os.getpid() % 10000}"
    names = [f"dtrain-n{i}-{tag}" for i in range(2)]
    veths = [f"dtv{i}-{tag}" for i in range(2)]
    net = os.getpid() % 250
    made = []
    try:
        for name in names:
            ip("netns", "add", name)
            made.append(name)
        ip("link", "add", veths[0], "type", "veth", "peer", "name", veths[1])
        for i, (name, veth) in enumerate(zip(names, veths)):
            ip("link", "set", veth, "netns", name)
            ip("-n", name, "addr", "add", f"{SUBNET.format(net, i + 1)}/24", "dev", veth)
            ip("-n", name, "link", "set", veth, "up")
            ip("-n", name, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as exc:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        pytest.skip(f"cannot make network namespaces here: {exc.stderr.strip()}")
    yield [(name, SUBNET.format(net, i + 1)) for i, name in enumerate(names)]
    for name in names:  # deleting a namespace deletes its end of the veth pair, and so the pair
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def run_on_both(nodes, run_dir, *extra, model="model.options={hidden_size = 32}", own_address=False):
    """The job on both namespaces; `own_address`: each node is told its address with --local-addr."""
    endpoint = f"{nodes[0][1]}:29{os.getpid() % 900 + 100}"
    procs = [
        subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                name,
                sys.executable,
                "-m",
                "dtrain",
                "run",
                *JOB,
                model,
                "--nnodes",
                "2",
                "--nproc",
                "1",
                "--rdzv-endpoint",
                endpoint,
                f"run.dir={run_dir}",
                *extra,
                *(["--local-addr", address] if own_address else []),
            ],
            cwd=ROOT,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, address in nodes
    ]
    outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err
    return [err for _, err in outs]


@pytest.fixture(scope="module")
def one_node(warm, tmp_path_factory):
    """The job on one node with 2 processes (on the warm workers: what the two nodes must equal)."""
    run_dir = tmp_path_factory.mktemp("one_node")
    ok(warm("run", *JOB, "model.options={hidden_size = 32}", "--nproc", "2", f"run.dir={run_dir}"))
    return run_dir


def same_weights(a, b):
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_two_nodes_train_like_one_node_with_two_processes(nodes, one_node, tmp_path):
    # Inside a namespace the hostname resolves to loopback: dtrain finds each node's own address
    # from the route to the endpoint; no --local-addr given.
    run_on_both(nodes, tmp_path)
    assert same_weights(one_node, tmp_path)


def test_local_addr_given_by_hand_works_the_same(nodes, one_node, tmp_path):
    run_on_both(nodes, tmp_path, own_address=True)
    assert same_weights(one_node, tmp_path)


def test_a_killed_worker_on_one_node_restarts_both_and_ends_the_same(nodes, one_node, tmp_path):
    errs = run_on_both(
        nodes,
        tmp_path,
        "--max-restarts",
        "1",
        "checkpoint.every_steps=5",
        model="model.options={hidden_size = 32, die_at_forward = 14, die_rank = 1}",
    )
    assert any(
        re.search(r"^resumed from \S+/checkpoints/step-10 \(step 10 of 26, epoch 1 of 2\)$", err, re.M) for err in errs
    ), errs
    assert same_weights(one_node, tmp_path)


@pytest.fixture(scope="module")
def waited(request, tmp_path_factory):
    """The commands of this module that wait for a first node that never answers, started side by side
    (their waits overlap): key → (endpoint, run.dir, exit status, timed lines). The one from a second
    node's namespace only where namespaces can be made."""
    folder = tmp_path_factory.mktemp("waits")
    job = [sys.executable, "-m", "dtrain", "run", *JOB, "--nnodes", "2", "--nproc", "1", "--rdzv-endpoint"]
    unresolved = "no-such-node.invalid:29500"
    commands = {
        "no name": ([*job, unresolved, "--rdzv-timeout", str(WAIT_TIMEOUT), f"run.dir={folder / 'name'}"], WAIT_ENV)
    }
    facts = {"no name": (unresolved, folder / "name")}
    with contextlib.suppress(pytest.skip.Exception):
        nodes = request.getfixturevalue("nodes")
        endpoint = f"{nodes[0][1]}:29{os.getpid() % 900 + 100}"
        prefix = ["ip", "netns", "exec", nodes[1][0]]
        commands["nobody serves"] = (
            [*prefix, *job, endpoint, "--rdzv-timeout", str(WAIT_TIMEOUT), f"run.dir={folder / 'nobody'}"],
            WAIT_ENV,
        )
        facts["nobody serves"] = (endpoint, folder / "nobody")
    return {key: (*facts[key], *said) for key, said in side_by_side(commands).items()}


def test_an_endpoint_nobody_serves_is_waited_for_then_given_up_in_one_line(nodes, waited):
    """node1 started alone: 2 s into the wait it says what it waits for, again at a slow pace, and
    after --rdzv-timeout gives up in one line — the whole output: no C++ stack traces, no worker."""
    endpoint, run_dir, code, lines = waited["nobody serves"]
    assert code == 2, lines
    where = re.escape(endpoint)
    assert_waited_then_gave_up(
        lines,
        rf"dtrain: waiting for the rendezvous at {where} \(the first node serves it; Connection refused\), "
        r"giving up in (?P<left>\d+) s \(--rdzv-timeout\)",
        rf"dtrain: error: nothing answered at {where} for {WAIT_TIMEOUT} s \(Connection refused\): start the "
        r"job on the node at that address, or check the address, the port and the firewall \(--rdzv-timeout "
        r"sets the wait\)",
    )
    assert not (run_dir / "metrics.jsonl").exists()


def test_the_first_node_says_it_waits_until_the_other_comes_then_no_more(nodes):
    """node0 alone says it waits for 1 more node; node1 started after that line: the group forms, and
    once the workers run (they say so, then work for three report periods) nothing more is said."""
    endpoint = f"{nodes[0][1]}:29{os.getpid() % 900 + 100}"

    def node(i):
        return subprocess.Popen(
            ["ip", "netns", "exec", nodes[i][0], sys.executable, "-m", "dtrain", "launch", "--nnodes", "2"]
            + ["--nproc", "1", "--rdzv-endpoint", endpoint, str(WORKERS / "slow_start.py"), str(3 * WAIT_EVERY)],
            cwd=ROOT,
            env=env(**WAIT_ENV),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    first = node(0)
    waiting = f"dtrain: waiting for 1 more node at {endpoint} (--nnodes 2), giving up in "
    lines = [first.stdout.readline().rstrip("\n")]
    if TORCH_REVERSE_LOOKUP in lines[0]:
        lines = [first.stdout.readline().rstrip("\n")]
    assert lines[0].startswith(waiting), lines
    second = node(1)
    lines += without_reverse_lookup(first.communicate(timeout=TIMEOUT)[0])
    out_second = without_reverse_lookup(second.communicate(timeout=TIMEOUT)[0])
    assert first.returncode == 0 and second.returncode == 0, (lines, out_second)
    started = lines.index("worker started")
    assert all(line.startswith(waiting) for line in lines[:started]), lines
    assert lines[started:] == ["worker started"], lines
    assert out_second == ["worker started"], out_second


def test_an_endpoint_whose_name_does_not_resolve_yet_is_waited_for_too(waited, cli, tmp_path):
    """A Kubernetes service or a SLURM head node that is not up yet has no address: wait for it, as for
    an endpoint that does not answer, then give up in one line. A wait of no sensible length is refused."""
    _, _, code, lines = waited["no name"]
    assert code == 2, lines
    assert_waited_then_gave_up(
        lines,
        r"dtrain: waiting for the rendezvous at no-such-node\.invalid:29500 \(the first node serves it; "
        r"no-such-node\.invalid does not resolve: [^)]+\), giving up in (?P<left>\d+) s \(--rdzv-timeout\)",
        rf"dtrain: error: nothing answered at no-such-node\.invalid:29500 for {WAIT_TIMEOUT} s "
        r"\(no-such-node\.invalid does not resolve: .+",
    )
    for bad in ("0.5", "1e20"):
        refused = cli(
            "run", *JOB, "--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-timeout", bad, f"run.dir={tmp_path}"
        )
        assert refused.returncode == 2 and refused.stderr.strip() == (
            f"dtrain: error: --rdzv-timeout must be from 1 to 10,000,000 seconds; got {float(bad):g}"
        ), refused.stderr


def test_the_elastic_last_call_is_torchruns_and_is_refused_where_no_group_waits_for_more(cli, tmp_path):
    """`--rdzv-last-call S` becomes the last-call wait of torch's own c10d rendezvous handler (read back
    from torchrun's parsing of the arguments dtrain forms); where the group never waits for more nodes
    (a fixed node count, a static rendezvous), or the wait is out of range, it is refused in one line."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _get_timeout
    from torch.distributed.run import config_from_args, get_args_parser

    from dtrain.launch import LaunchSpec, torchrun_args

    spec = LaunchSpec(nproc=1, nnodes="1:2", rdzv_endpoint="10.0.0.1:29500", rdzv_last_call=3)
    spec.validate()
    config, _, _ = config_from_args(get_args_parser().parse_args(torchrun_args(spec, ["train.py"])))
    params = RendezvousParameters("c10d", config.rdzv_endpoint, config.run_id, 1, 2, **config.rdzv_configs)
    assert _get_timeout(params, "last_call").total_seconds() == 3
    assert _get_timeout(params, "join").total_seconds() == 600  # --rdzv-timeout's default, still there
    default = LaunchSpec(nproc=1, nnodes="1:2", rdzv_endpoint="10.0.0.1:29500")
    config, _, _ = config_from_args(get_args_parser().parse_args(torchrun_args(default, ["train.py"])))
    assert "last_call_timeout" not in config.rdzv_configs  # torchrun's own default then
    endpoint = ["--rdzv-endpoint", "h:1"]
    for flags, message in [
        (["--nnodes", "2", *endpoint, "--rdzv-last-call", "5"], "with --nnodes 2 the group never waits"),
        (
            ["--nnodes", "1:2", "--node-rank", "0", *endpoint, "--rdzv-last-call", "5"],
            "with --nnodes 1:2 and --node-rank the group never waits",
        ),
        (["--nnodes", "1:2", *endpoint, "--rdzv-last-call", "0"], "must be from 1 to --rdzv-timeout (600) seconds"),
        (["--nnodes", "1:2", *endpoint, "--rdzv-timeout", "20", "--rdzv-last-call", "30"], "(20) seconds; got 30"),
    ]:
        refused = cli("run", *JOB, *flags, f"run.dir={tmp_path}")
        assert refused.returncode == 2 and len(refused.stderr.splitlines()) == 1, refused.stderr
        assert refused.stderr.startswith("dtrain: error: --rdzv-last-call ") and message in refused.stderr, flags
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "endpoint, reason",
    [
        ("0.0.0.0:29500", "0.0.0.0 is the unspecified address, never a node's address"),
        ("224.0.0.1:29500", "224.0.0.1 is a multicast address, never a node's address"),
        ("255.255.255.255:29500", "255.255.255.255 is a reserved address, never a node's address"),
    ],
)
def test_an_endpoint_no_node_can_have_is_refused_at_once(cli, tmp_path, endpoint, reason):
    """A wait that cannot end is not begun: an address no interface holds is refused in one line."""
    start = time.monotonic()
    result = cli(
        "run",
        *JOB,
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-timeout",
        "20",
        f"run.dir={tmp_path}",
        extra_env=WAIT_ENV,
    )
    assert result.returncode == 2 and (result.stdout + result.stderr).splitlines() == [
        f"dtrain: error: --rdzv-endpoint {endpoint} cannot be reached from this node ({reason}): give an "
        "address of the first node that every node can reach"
    ], result.stderr
    assert time.monotonic() - start < 10  # no wait begun


def test_an_endpoint_this_node_has_no_route_to_is_refused_at_once(nodes, tmp_path):
    """node1's namespace routes only its own subnet: an endpoint elsewhere can never answer."""
    result = run(
        ["ip", "netns", "exec", nodes[1][0], sys.executable, "-m", "dtrain", "run", *JOB, "--nnodes", "2"]
        + ["--rdzv-endpoint", "10.99.0.1:29500", "--rdzv-timeout", "20", f"run.dir={tmp_path}"],
        extra_env=WAIT_ENV,
    )
    assert result.returncode == 2 and (result.stdout + result.stderr).splitlines() == [
        "dtrain: error: --rdzv-endpoint 10.99.0.1:29500 cannot be reached from this node (Network is "
        "unreachable): give an address of the first node that every node can reach"
    ], result.stderr


def test_more_nodes_than_the_slurm_job_has_are_refused_at_once(tmp_path):
    """Under SLURM the nodes that can come are SLURM_NNODES: asking for more would wait for nothing."""
    result = run(
        [sys.executable, "-m", "dtrain", "run", *JOB, "--nnodes", "3", "--rdzv-endpoint", "127.0.0.1:29500"]
        + [f"run.dir={tmp_path}"],
        extra_env={"SLURM_NNODES": "2", "SLURM_JOB_ID": "7"},
    )
    assert result.returncode == 2 and (result.stdout + result.stderr).splitlines() == [
        "dtrain: error: --nnodes 3 needs 3 nodes and this SLURM job has SLURM_NNODES=2: use --nnodes 2 or "
        "fewer, or ask SLURM for more nodes"
    ], result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


GPT_JOB = [
    "examples/gpt_stdlib.toml",
    "data.block_size=16",
    "data.batch_size=4",
    "training.epochs=1",
    "training.max_steps=400",
    "training.log_every=20",
    "checkpoint.every_steps=10",
    "model.options={n_layer = 1, n_head = 2, n_embd = 16}",
    "scheduler.warmup_steps=2",
]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    """Token shards of this package's own source (byte tokens: no tokenizer to train)."""
    out = tmp_path_factory.mktemp("tokens") / "bytes"
    ok(
        run(
            [
                sys.executable,
                "-m",
                "dtrain",
                "prepare",
                "text",
                str(ROOT / "src" / "dtrain"),
                "--out",
                str(out),
                "--tokenizer",
                "bytes",
            ]
        )
    )
    return out


def test_a_node_lost_for_good_leaves_the_job_running_on_fewer(nodes, tokens, tmp_path):
    """`--nnodes 1:2`: two nodes train; one is killed for good (SIGKILL of its launcher, as a machine
    that dies). The other's group fails, torchrun forms a new one of the nodes left (1 ≥ MIN), and the
    job continues from the last checkpoint on one process, accumulation doubled to keep the global
    batch (token data resumes on any number of processes), to the end."""
    run_dir = tmp_path / "run"
    endpoint = f"{nodes[0][1]}:29{os.getpid() % 900 + 100}"
    procs = [
        subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                name,
                sys.executable,
                "-m",
                "dtrain",
                "run",
                *GPT_JOB,
                f"data.path={tokens}",
                "--nnodes",
                "1:2",
                "--nproc",
                "1",
                "--rdzv-endpoint",
                endpoint,
                "--max-restarts",
                "2",
                "--rdzv-last-call",
                "2",  # the re-formed group waits 2 s, not torchrun's 30, for a node that might still come
                f"run.dir={run_dir}",
            ],
            cwd=ROOT,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, _ in nodes
    ]
    deadline = time.monotonic() + TIMEOUT
    while not (run_dir / "checkpoints" / "step-10" / "COMPLETE.json").exists():
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "no checkpoint came"
        time.sleep(0.05)
    procs[1].kill()  # node1 is gone; its worker dies with its launcher
    _, err = procs[0].communicate(timeout=TIMEOUT)
    procs[1].communicate()
    assert procs[0].returncode == 0, err
    assert re.search(
        r"^restart 1 of at most 2 \(torchrun\): a process of the group failed or a node left; the "
        r"group re-formed with 1 process\(es\)$",
        err,
        re.M,
    ), err
    resumed = re.search(r"^resumed from \S+/checkpoints/step-(\d+) \(step \d+ of 400, epoch 1 of 1\)$", err, re.M)
    assert resumed and int(resumed.group(1)) >= 10, err
    assert re.search(
        rf"^step-{resumed.group(1)} was written by 2 processes and this run has 1: "
        r"training.grad_accum_steps 1 → 2 keeps its global batch of 8 samples$",
        err,
        re.M,
    ), err
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in lines if "loss" in r]
    assert steps == list(range(20, 401, 20))  # every window once, the interrupted ones again from the checkpoint
    assert all(len(r["rank_busy_ms"]) == 1 for r in lines if "loss" in r and r["step"] > int(resumed.group(1)))
    assert (run_dir / "model.safetensors").exists()
