"""run.dir on object storage: `run.dir = s3://bucket/prefix` against a real S3 protocol server on loopback
(moto's server mode, tests/s3server.py), found by the launcher and its torchrun workers through boto's
usual environment. Each machine is a cache folder of its own (XDG_CACHE_HOME): a run resumed on another
one can only have read its checkpoint from the store. Nothing of fsspec, s3fs or boto is mocked."""

import json
import os
import re
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load as load_safetensors

from dtrain.checkpoint.store import MARKER
from helpers import ROOT, TIMEOUT, WORKERS, dtrain, env, ok, weights

MAIN = [
    "examples/digits_mlp.toml",
    "--nproc",
    "2",
    "training.max_steps=12",
    "checkpoint.every_steps=5",
    "training.eval_every_steps=5",
    "checkpoint.keep_best=eval_loss",
]
# A synthetic job whose rank 0 can be killed (SIGKILL) in its 23rd training forward pass; 39 steps in all.
JOB = [
    "examples/digits_mlp.toml",
    "--nproc",
    "2",
    "data.name=synthetic",
    "data.num_samples=500",
    "data.input_shape=[12]",
    "data.num_classes=3",
    "data.batch_size=16",
    "model.name=faults:dying_mlp",
    "training.epochs=3",
    "training.log_every=1",
]
MODEL = "model.options={hidden_size = 32%s}"


def on(s3, machine):
    """The environment of a job on `machine`: the store's credentials, the machine's own cache."""
    return {**s3.env, "XDG_CACHE_HOME": str(machine)}


def objects(s3, prefix):
    fs = s3.filesystem()
    root = f"{s3.bucket}/{prefix}"
    return {name[len(root) + 1 :]: info["size"] for name, info in fs.find(root, detail=True).items()}


def stored_weights(s3, prefix):
    return load_safetensors(s3.filesystem().cat_file(f"{s3.bucket}/{prefix}/model.safetensors"))


def complete_json_last(s3, prefix):
    """For each step-N/ under the prefix's checkpoints: whether COMPLETE.json was its last PUT."""
    puts: dict[str, list[str]] = {}
    for method, path, _ in s3.requests():
        found = re.search(rf"/{re.escape(prefix)}/checkpoints/(step-\d+)/([^?]+)", path)
        if method == "PUT" and found:
            puts.setdefault(found.group(1), []).append(found.group(2))
    return {step: names[-1] == MARKER for step, names in puts.items()}


@pytest.fixture(scope="module")
def main_job(warm, s3, tmp_path_factory):
    """The default digits MLP on 2 processes, into a local folder and into the bucket."""
    tmp = tmp_path_factory.mktemp("s3-main")
    ok(warm("run", *MAIN, f"run.dir={tmp / 'local'}"))
    result = ok(warm("run", *MAIN, f"run.dir={s3.url('runs/main')}", extra_env=on(s3, tmp / "machine")))
    return tmp / "local", result


def test_the_main_job_on_the_bucket_trains_bitwise_as_in_a_local_folder(s3, main_job):
    local, _ = main_job
    stored = objects(s3, "runs/main")
    assert {"config.toml", "metrics.jsonl", "model.safetensors"} <= set(stored)
    assert any(name.startswith("tensorboard/events.out.tfevents.") for name in stored)
    assert ".lease" not in stored  # released at the end
    # keep = 3 of step-5, -10, -12; each sealed by its COMPLETE.json, written after its other objects
    steps = sorted({name.split("/")[1] for name in stored if name.startswith("checkpoints/step-")})
    assert steps == ["step-10", "step-12", "step-5"] and all(f"checkpoints/{s}/{MARKER}" in stored for s in steps)
    assert all(complete_json_last(s3, "runs/main").values()) and complete_json_last(s3, "runs/main")
    # checkpoint.keep_best's choice is on the store too: a resume on another machine spares the same one
    best = s3.filesystem().cat_file(f"{s3.bucket}/runs/main/checkpoints/best.json")
    assert json.loads(best)["step"] in (5, 10, 12) and best == (local / "checkpoints" / "best.json").read_bytes()
    mine, theirs = stored_weights(s3, "runs/main"), weights(local)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    stored_lines = s3.filesystem().cat_file(f"{s3.bucket}/runs/main/metrics.jsonl").decode().splitlines()
    local_lines = (local / "metrics.jsonl").read_text().splitlines()
    losses = [
        [(r["step"], r["loss"]) for r in map(json.loads, lines) if "loss" in r] for lines in (stored_lines, local_lines)
    ]
    assert losses[0] == losses[1] and len(losses[0]) == 2  # logged at steps 10 and 12


def test_the_credentials_are_written_nowhere(s3, main_job):
    _, result = main_job
    config = s3.filesystem().cat_file(f"{s3.bucket}/runs/main/config.toml").decode()
    assert f'dir = "{s3.url("runs/main")}"' in config
    for secret in (s3.secret, s3.key):
        assert secret not in result.stdout + result.stderr and secret not in config


@pytest.fixture(scope="module")
def reference(warm, tmp_path_factory):
    """JOB uninterrupted, into a local folder: what every interrupted run on the bucket must end as."""
    run_dir = tmp_path_factory.mktemp("s3-reference") / "run"
    ok(warm("run", *JOB, MODEL % "", f"run.dir={run_dir}"))
    return run_dir


def test_killed_then_resumed_on_another_machine_is_bitwise_and_takes_no_partial_prefix(warm, s3, reference, tmp_path):
    url, prefix = s3.url("runs/killed"), "runs/killed"
    dying = MODEL % ", die_at_forward = 23, die_rank = 0"  # rank 0, the lease holder: after step-20
    first = dtrain("run", *JOB, dying, "checkpoint.every_steps=5", f"run.dir={url}", extra_env=on(s3, tmp_path / "a"))
    assert first.returncode != 0
    stored = objects(s3, prefix)
    assert f"checkpoints/step-20/{MARKER}" in stored and ".lease" in stored  # kill -9: never released
    # A write cut short on the store: objects under step-33/, no COMPLETE.json. Never taken, then removed.
    s3.filesystem().pipe_file(f"{s3.bucket}/{prefix}/checkpoints/step-33/state/__0_0.distcp", b"half")
    # Another machine (its own empty cache). The killed run's lease must expire first: it is refused until then.
    later = on(s3, tmp_path / "b")
    refused = dtrain("run", *JOB, dying, "checkpoint.every_steps=5", f"run.dir={url}", extra_env=later)
    assert refused.returncode == 2 and "is in use by another run" in refused.stderr, refused.stderr
    expire = s3.filesystem()
    lease = json.loads(expire.cat_file(f"{s3.bucket}/{prefix}/.lease"))
    expire.pipe_file(f"{s3.bucket}/{prefix}/.lease", json.dumps({**lease, "expires": lease["expires"] - 3600}).encode())
    second = ok(warm("run", *JOB, dying, "checkpoint.every_steps=5", f"run.dir={url}", extra_env=later))
    assert re.search(r"^resumed from \S+/checkpoints/step-20 \(step 20 of 39", second.stderr, re.M), second.stderr
    assert "took over the lease on run.dir from pid " in second.stderr + second.stdout
    stored = objects(s3, prefix)
    assert not any(name.startswith("checkpoints/step-33/") for name in stored), sorted(stored)
    assert not [r for r in s3.requests() if r[0] == "GET" and "/step-33/" in r[1]]  # never read from
    mine, theirs = stored_weights(s3, prefix), weights(reference)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.mark.parametrize("case", ["no bucket", "wrong secret", "password in URL", "not s3"])
def test_a_store_that_refuses_is_one_line_from_the_launcher(s3, tmp_path, case):
    url, extra = s3.url("runs/refused"), on(s3, tmp_path / "machine")
    if case == "no bucket":
        url = "s3://no-such-bucket/run"
        expected = "run.dir = 's3://no-such-bucket/run/.lease': bucket 'no-such-bucket' does not exist"
    elif case == "wrong secret":
        extra["AWS_SECRET_ACCESS_KEY"] = "AKIAWRONGWRONGWRONG0"
        expected = f"run.dir = '{url}/.lease': the store refused these credentials ("
    elif case == "not s3":  # no conditional writes, so no lease
        url = "gs://bucket/run"
        expected = "run.dir = 'gs://bucket/run': a run.dir on object storage must be on an S3-compatible store"
    else:
        url = url.replace("s3://", f"s3://{s3.key}:{s3.secret}@")
        expected = f"run.dir = '{s3.url('runs/refused')}' carries a password in the URL"
    config = ROOT / "examples" / "digits_mlp.toml"
    result = dtrain("run", str(config), f"run.dir={url}", "--nproc", "2", extra_env=extra, cwd=tmp_path)
    lines = (result.stdout + result.stderr).splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("dtrain: error: " + expected), lines
    assert s3.secret not in lines[0] and list(tmp_path.iterdir()) == []  # nothing written, not even a cache


def test_checkpoints_written_in_the_background_reach_the_bucket_sealed(warm, s3, main_job, tmp_path):
    """checkpoint.async: each checkpoint is sent once sealed (when training sees it done), COMPLETE.json
    last, and the run ends as the synchronous one."""
    local, _ = main_job
    ok(warm("run", *MAIN, "checkpoint.async=true", f"run.dir={s3.url('runs/async')}", extra_env=on(s3, tmp_path)))
    stored = objects(s3, "runs/async")
    assert all(f"checkpoints/step-{n}/{MARKER}" in stored for n in (5, 10, 12)), sorted(stored)
    assert all(complete_json_last(s3, "runs/async").values())
    mine, theirs = stored_weights(s3, "runs/async"), weights(local)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


def same_as(s3, prefix, reference):
    mine, theirs = stored_weights(s3, prefix), weights(reference)
    return mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def expire_lease(s3, prefix):
    """As if the lease of a run killed with -9 had run out (its term is minutes)."""
    fs = s3.filesystem()
    lease = json.loads(fs.cat_file(f"{s3.bucket}/{prefix}/.lease"))
    fs.pipe_file(f"{s3.bucket}/{prefix}/.lease", json.dumps({**lease, "expires": lease["expires"] - 3600}).encode())


def on_two_nodes(s3, machines, *args):
    """JOB as a job of two nodes on this machine: two launchers of one process each, joined on loopback,
    each with a cache (so a staging folder) of its own, as two machines without a shared file system."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{probe.getsockname()[1]}"
    one_process = [JOB[0], *JOB[3:]]  # JOB less its --nproc 2
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "dtrain", "run", *one_process, *args, "--nnodes", "2", "--node-rank", str(rank)]
            + ["--nproc", "1", "--rdzv-endpoint", endpoint],
            cwd=ROOT,
            env=env(**on(s3, machine)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, machine in enumerate(machines)
    ]
    outs = [node.communicate(timeout=TIMEOUT) for node in nodes]
    return [(node.returncode, err) for node, (_, err) in zip(nodes, outs)]


def test_two_nodes_each_with_its_own_staging_folder_seal_both_ranks_files_and_resume_bitwise(s3, reference, tmp_path):
    """run.dir on the bucket, two nodes without a shared file system: each complete step-N on the store
    holds both ranks' shards and its COMPLETE.json lists them all; the job killed (node 1's process) is
    resumed by two other machines, which only the store can have given the checkpoint, bitwise."""
    url, prefix = s3.url("runs/nodes"), "runs/nodes"
    dying = MODEL % ", die_at_forward = 23, die_rank = 1"  # node 1's process, after step-20
    first = on_two_nodes(s3, [tmp_path / "a0", tmp_path / "a1"], dying, "checkpoint.every_steps=5", f"run.dir={url}")
    assert all(rc != 0 for rc, _ in first), first
    stored = objects(s3, prefix)
    complete = sorted(int(n.split("/")[1][5:]) for n in stored if n.startswith("checkpoints/") and n.endswith(MARKER))
    assert complete == [10, 15, 20], sorted(stored)  # keep = 3
    for step in complete:
        under = f"checkpoints/step-{step}/"
        names = {n[len(under) :]: size for n, size in stored.items() if n.startswith(under)}
        for rank in (0, 1):  # each node's own files, sent from its own staging folder
            assert f"state/__{rank}_0.distcp" in names and f"rng-rank{rank}.safetensors" in names, sorted(names)
        marker = json.loads(s3.filesystem().cat_file(f"{s3.bucket}/{prefix}/{under}{MARKER}"))
        assert {n: f["bytes"] for n, f in marker["files"].items()} == {n: b for n, b in names.items() if n != MARKER}
    assert all(complete_json_last(s3, prefix).values())
    if ".lease" in stored:  # rank 0 may not have lived to give it back
        expire_lease(s3, prefix)
    second = on_two_nodes(s3, [tmp_path / "b0", tmp_path / "b1"], dying, "checkpoint.every_steps=5", f"run.dir={url}")
    assert [rc for rc, _ in second] == [0, 0], second
    assert re.search(r"^resumed from \S+/checkpoints/step-20 \(step 20 of 39", second[0][1], re.M), second[0][1]
    assert same_as(s3, prefix, reference)


# Just before the PUT, sync and async; just after it, async (sync seals the same way, on the training thread).
@pytest.mark.parametrize(
    "when, background",
    [("before", False), ("before", True), ("after", True)],
    ids=["sync-before", "async-before", "async-after"],
)
def test_a_kill_as_a_checkpoint_is_sealed_on_the_store_leaves_none_that_only_this_machine_holds(
    warm, s3, reference, tmp_path, when, background
):
    """kill -9 of rank 0 just before or just after the store's COMPLETE.json of step-15: this machine's
    staging folder then holds no sealed checkpoint that the store lacks (the store is sealed first), and
    the run resumed here from what the store holds — step-10, or step-15 — ends bitwise as one never
    interrupted."""
    url, prefix = s3.url(f"runs/seal-{when}-{background}"), f"runs/seal-{when}-{background}"
    faults = os.pathsep.join([str(WORKERS / "process_faults"), env()["PYTHONPATH"]])
    job = [
        *JOB,
        MODEL % "",
        "checkpoint.every_steps=5",
        f"checkpoint.async={str(background).lower()}",
        f"run.dir={url}",
    ]
    here = on(s3, tmp_path / "machine")
    first = dtrain("run", *job, extra_env={**here, "PYTHONPATH": faults, "KILL_AT_STORE_SEAL": f"15:{when}"})
    assert first.returncode != 0
    on_store = RemoteSteps(s3, prefix)
    assert on_store.complete == ([5, 10, 15] if when == "after" else [5, 10]), on_store.complete
    assert when == "after" or on_store.partial == [15]  # every object there, but no COMPLETE.json
    (staging,) = (tmp_path / "machine" / "dtrain" / "run-dirs").iterdir()
    sealed_here = sorted(int(p.name[5:]) for p in (staging / "checkpoints").glob("step-*") if (p / MARKER).is_file())
    assert set(sealed_here) <= set(on_store.complete) and 15 not in sealed_here, (sealed_here, on_store.complete)
    expire_lease(s3, prefix)
    second = ok(warm("run", *job, extra_env=here))
    resumed = 15 if when == "after" else 10
    assert re.search(rf"^resumed from \S+/checkpoints/step-{resumed} \(step {resumed} of 39", second.stderr, re.M)
    assert same_as(s3, prefix, reference)


class RemoteSteps:
    """The steps under a run.dir's checkpoints/ on the store: with COMPLETE.json, and without."""

    def __init__(self, s3, prefix):
        steps: dict[int, set[str]] = {}
        for name in objects(s3, f"{prefix}/checkpoints"):
            folder, _, rest = name.partition("/")
            steps.setdefault(int(folder[5:]), set()).add(rest)
        self.complete = sorted(step for step, names in steps.items() if MARKER in names)
        self.partial = sorted(step for step, names in steps.items() if MARKER not in names)
