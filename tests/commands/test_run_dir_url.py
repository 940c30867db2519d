"""A run.dir on object storage read by the commands that read a run (`dtrain generate`, `report`, `export`),
export written to a store (`--out s3://…`), and a run that loses its lease while it trains — against a real
S3 protocol server on loopback (moto's server mode, tests/s3server.py). Nothing of fsspec, s3fs or boto is
mocked. One GPT run on the bucket serves every read: its local run.dir is a plain download of the bucket.
The reading commands run in this process (the `cli` fixture: `dtrain.cli.main`, each with the credentials
its environment gives, as a new process would); the runs that lose their lease are real processes."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import ROOT, env, ok

transformers = pytest.importorskip("transformers")  # the test extra installs it

GPT = [
    "examples/gpt_stdlib.toml",
    "data.block_size=32",
    "data.batch_size=4",
    "training.epochs=1",
    "training.max_steps=8",
    "training.log_every=2",
    "model.options={n_layer = 1, n_head = 2, n_embd = 32}",
    "scheduler.warmup_steps=2",
    "checkpoint.every_steps=4",
]


def on(s3, machine):
    """The environment of a command on `machine`: the store's credentials, the machine's own cache."""
    return {**s3.env, "XDG_CACHE_HOME": str(machine)}


def one_line_refusal(result, starts):
    lines = (result.stdout + result.stderr).splitlines()
    assert result.returncode == 2 and len(lines) == 1, (result.returncode, lines)
    assert lines[0].startswith("dtrain: error: " + starts), lines[0]


@pytest.fixture(scope="module")
def prepared(json_bpe_tokens):
    return json_bpe_tokens


@pytest.fixture(scope="module")
def gpt_on_the_bucket(warm, s3, prepared, tmp_path_factory):
    """(its URL, the same run.dir downloaded to a local folder, a machine's cache) of one GPT run."""
    tmp = tmp_path_factory.mktemp("gpt-url")
    url = s3.url("runs/gpt")
    ok(warm("run", *GPT, f"data.path={prepared}", f"run.dir={url}", extra_env=on(s3, tmp / "trainer")))
    local = tmp / "local"
    s3.filesystem().get(f"{s3.bucket}/runs/gpt/", str(local), recursive=True)
    os.utime(local / "model.safetensors")  # downloaded last: the final weights are the newest, as on the bucket
    return url, local, tmp / "reader"


def test_generate_and_report_on_the_bucket_say_what_they_say_on_the_local_run_dir(s3, gpt_on_the_bucket, cli):
    url, local, reader = gpt_on_the_bucket
    sample = ["--prompt", "def ", "--tokens", "16", "--temperature", "0"]
    here, there = (
        ok(cli("generate", str(local), *sample)),
        ok(cli("generate", url, *sample, extra_env=on(s3, reader))),
    )
    assert here.stdout == there.stdout and len(there.stdout) > len("def ") and there.stderr == ""
    # A checkpoint prefix without COMPLETE.json (a write cut short) is never read, even where it is newer.
    s3.filesystem().pipe_file(f"{s3.bucket}/runs/gpt/checkpoints/step-9/state/__0_0.distcp", b"half")
    assert ok(cli("generate", url, *sample, extra_env=on(s3, reader))).stdout == here.stdout
    assert not [r for r in s3.requests() if r[0] == "GET" and "/step-9/" in r[1]]
    here, there = ok(cli("report", str(local))), ok(cli("report", url, extra_env=on(s3, reader)))
    summary = here.stdout.splitlines()[:-1]  # the last line names where the plots are
    assert summary and there.stdout.splitlines()[:-1] == summary
    shown = Path(there.stdout.splitlines()[-1].rsplit(" in ", 1)[1])
    assert shown.is_relative_to(reader) and (shown / "loss.png").is_file()  # under the reader's cache
    assert "report/summary.txt" not in {n.split("runs/gpt/", 1)[-1] for n in s3.filesystem().find(s3.bucket)}
    # Nothing read took the lease or wrote to the bucket: every request to the run's prefix was a read.
    assert ".lease" not in s3.filesystem().ls(f"{s3.bucket}/runs/gpt")


def same_export(a: Path, b: Path) -> None:
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_export_from_the_bucket_equals_the_local_export_and_to_the_bucket_loads(s3, gpt_on_the_bucket, cli, tmp_path):
    from dtrain.export.hf import export_hf  # the local exports: what `dtrain export` runs, here

    url, local, reader = gpt_on_the_bucket
    final, at_4 = export_hf(local, tmp_path / "final"), export_hf(local, tmp_path / "at-4", step=4)
    said = ok(cli("export", url, "--format", "hf", "--out", str(tmp_path / "url"), extra_env=on(s3, reader)))
    assert said.stdout.startswith(f"{tmp_path / 'url'}: the final weights of {url} as a Hugging Face model folder")
    same_export(final, tmp_path / "url")
    # --out on the bucket: config.json last, after every other object; downloaded, from_pretrained loads it.
    target, prefix = s3.url("exports/gpt"), f"{s3.bucket}/exports/gpt"
    said = ok(cli("export", url, "--format", "hf", "--step", "4", "--out", target, extra_env=on(s3, reader)))
    assert said.stdout.startswith(f"{target}: the checkpoint step-4 of {url} as a Hugging Face model folder")
    puts = [p.split("?")[0] for m, p, status in s3.requests() if m == "PUT" and "/exports/gpt/" in p and status == 200]
    assert len(puts) == len(list(at_4.iterdir())) and puts[-1].endswith("/config.json"), puts
    s3.filesystem().get(f"{prefix}/", str(tmp_path / "down-4"), recursive=True)
    same_export(at_4, tmp_path / "down-4")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "down-4").eval()
    reference = transformers.AutoModelForCausalLM.from_pretrained(at_4).eval()
    ids = torch.arange(32)[None] % 300
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    # Exported again over it: the earlier export replaced (its config.json deleted first), not refused.
    requests_before = len(s3.requests())
    ok(cli("export", url, "--format", "hf", "--out", target, extra_env=on(s3, reader)))
    writes = [(m, p.split("?")[0]) for m, p, _ in s3.requests()[requests_before:] if m in ("PUT", "DELETE")]
    writes = [(m, p) for m, p in writes if "/exports/gpt/" in p]
    assert writes[0] == ("DELETE", f"/{prefix}/config.json") and writes[-1] == ("PUT", f"/{prefix}/config.json")
    s3.filesystem().get(f"{prefix}/", str(tmp_path / "down-final"), recursive=True)
    same_export(final, tmp_path / "down-final")


def test_a_run_dir_url_the_commands_cannot_read_is_one_line(s3, gpt_on_the_bucket, cli, tmp_path):
    url, _, reader = gpt_on_the_bucket
    extra = on(s3, reader)
    one_line_refusal(
        cli("generate", "s3://no-such-bucket/run", extra_env=extra),
        "RUN_DIR = 's3://no-such-bucket/run': bucket 'no-such-bucket' does not exist",
    )
    one_line_refusal(
        cli("report", s3.url("runs/nothing-here"), extra_env=extra),
        f"RUN_DIR {s3.url('runs/nothing-here')} holds nothing",
    )
    one_line_refusal(
        cli("export", url, "--format", "hf", "--step", "9", extra_env=extra),
        f"{url} holds no complete checkpoint step-9 (complete ones: step-4, step-8)",
    )
    wrong = {**extra, "AWS_SECRET_ACCESS_KEY": "AKIAWRONGWRONGWRONG0"}
    one_line_refusal(
        cli("export", url, "--format", "hf", extra_env=wrong),
        f"RUN_DIR = '{url}': the store refused these credentials (",
    )
    s3.filesystem().pipe_file(f"{s3.bucket}/exports/theirs/notes.txt", b"mine")
    one_line_refusal(
        cli("export", url, "--format", "hf", "--out", s3.url("exports/theirs"), extra_env=extra),
        f"--out {s3.url('exports/theirs')} holds notes.txt, which an export does not write",
    )
    assert not list(reader.glob("dtrain/run-reads/read-*")) and not list(reader.glob("dtrain/run-reads/export-*"))


# A synthetic job slowed to about 0.2 s a step, 2 processes, long enough to have its lease taken from it.
SLOW = [
    "examples/digits_mlp.toml",
    "--nproc",
    "2",
    "data.name=synthetic",
    "data.num_samples=4000",
    "data.input_shape=[12]",
    "data.num_classes=3",
    "data.batch_size=16",
    "model.name=faults:dying_mlp",
    "model.options={hidden_size = 32, step_sleep_s = 0.2}",
    "training.epochs=1",
    "training.log_every=1",
    "checkpoint.every_steps=1000",  # one at the end only: a run stopped before it has none
]


# Whose lease it is once another run took it over (as after an expiry; its expiry is set when taken).
NEW_HOLDER = {"host": "elsewhere", "pid": 4242, "run": "the-new-one", "since": "now"}


def start_on_the_store(s3, tmp_path, url, *overrides):
    """`dtrain run SLOW` on run.dir `url`, its lease renewed every second."""
    return subprocess.Popen(
        [sys.executable, "-m", "dtrain", "run", *SLOW, f"run.dir={url}", *overrides],
        cwd=ROOT,
        env=env(**on(s3, tmp_path), DTRAIN_LEASE_TERM_S="3"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def take_the_lease_over(s3, prefix, run, once_sent: bytes) -> tuple[dict, int]:
    """Once the store's metrics.jsonl holds `once_sent`, another run takes the lease over; returns when the
    run's renewal has found it taken: the new holder's lease, and the requests the store had answered then."""
    fs, deadline = s3.filesystem(), time.time() + 120
    lease, metrics = f"{s3.bucket}/{prefix}/.lease", f"{s3.bucket}/{prefix}/metrics.jsonl"
    while once_sent not in (fs.cat_file(metrics) if fs.exists(metrics) else b""):  # training, and sending
        assert run.poll() is None and time.time() < deadline, run.communicate()
        time.sleep(0.2)
        fs.invalidate_cache()
    taken_at, holder = len(s3.requests()), {**NEW_HOLDER, "expires": time.time() + 600}
    fs.pipe_file(lease, json.dumps(holder).encode())
    while not [r for r in s3.requests()[taken_at:] if r[0] == "PUT" and r[1].startswith(f"/{lease}") and r[2] == 412]:
        assert run.poll() is None and time.time() < deadline, run.communicate()
        time.sleep(0.1)  # until the run's renewal finds it taken
    return holder, len(s3.requests())


def the_line_of_a_run_that_lost_run_dir(run, url) -> str:
    """The one `dtrain:` line of a run that ended with exit 73, naming run.dir and its new holder."""
    try:
        out, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    lines = [line for line in (out + err).splitlines() if line.startswith("dtrain:")]
    assert run.returncode == 73, (run.returncode, out, err)
    said = f"dtrain: error: run.dir {url}: another run took its lease over (pid 4242 on elsewhere, run the-new-one"
    assert len(lines) == 1 and lines[0].startswith(said), lines
    return lines[0]


def test_a_run_whose_lease_is_taken_over_stops_and_writes_nothing_more(s3, tmp_path):
    """Another run takes the lease over (as after an expiry): the run stops at its next step with one line
    naming run.dir and what happened, exit 73, no checkpoint, and the store stays as the new holder left it."""
    prefix = "runs/taken"
    url, fs = s3.url(prefix), s3.filesystem()
    lease, metrics = f"{s3.bucket}/{prefix}/.lease", f"{s3.bucket}/{prefix}/metrics.jsonl"
    run = start_on_the_store(s3, tmp_path, url)
    new_holder, found_at = take_the_lease_over(s3, prefix, run, once_sent=b'"loss"')
    fs.pipe_file(metrics, b"")  # the new holder writes there as the run.dir's owner
    line = the_line_of_a_run_that_lost_run_dir(run, url)
    assert re.search(r"; this run stopped at step \d+ and wrote nothing more there$", line), line
    fs.invalidate_cache()
    assert json.loads(fs.cat_file(lease)) == new_holder and fs.cat_file(metrics) == b""
    assert not fs.exists(f"{s3.bucket}/{prefix}/model.safetensors") and not fs.exists(
        f"{s3.bucket}/{prefix}/checkpoints"
    )
    # Nothing written there once the run knew: its own requests after that are reads, or refused.
    after = [r for r in s3.requests()[found_at:] if f"/{prefix}/" in r[1] and r[0] in ("PUT", "POST", "DELETE")]
    assert all(status >= 400 for _, _, status in after[1:]), after  # [0]: the new holder's metrics
    # No checkpoint at the stop, not even in the local staging folder.
    assert not list(tmp_path.glob("dtrain/run-dirs/*/checkpoints/step-*")), list(tmp_path.glob("dtrain/run-dirs/*/*"))


def test_a_run_whose_lease_is_taken_over_after_its_last_step_says_where_its_final_weights_are(s3, tmp_path):
    """The lease taken over during the evaluation after the last step: the run still writes its final
    weights, into the staging folder only (the store is the new holder's), and ends with exit 73 and one
    line saying where they are — not 0, as if the store held them."""
    prefix = "runs/taken-at-the-end"
    url, fs = s3.url(prefix), s3.filesystem()
    slow_eval = "model.options={hidden_size = 32, step_sleep_s = 0.05, eval_sleep_s = 1.0}"
    run = start_on_the_store(s3, tmp_path, url, "data.num_samples=640", slow_eval, "training.eval_batches=8")
    # 16 steps (512 of the 640 samples train): the last one's line is sent as the 8 s evaluation runs.
    new_holder, _ = take_the_lease_over(s3, prefix, run, once_sent=b'"step": 16, ')
    line = the_line_of_a_run_that_lost_run_dir(run, url)
    (staging,) = tmp_path.glob("dtrain/run-dirs/*")
    assert line.endswith(
        f"; what this run wrote after that (its final weights among them, once written) was not sent there and is "
        f"only in {staging} on this machine: copy it out before a run on the same run.dir starts here"
    ), line
    assert load_file(staging / "model.safetensors")  # whole, where the line says
    fs.invalidate_cache()
    assert json.loads(fs.cat_file(f"{s3.bucket}/{prefix}/.lease")) == new_holder
    assert not fs.exists(f"{s3.bucket}/{prefix}/model.safetensors")
