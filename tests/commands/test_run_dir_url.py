"""A run.dir on object storage read by the commands that read a run (`dtrain generate`, `report`, `export`),
export written to a store (`--out s3://…`), and a run that loses its lease while it trains — against a real
S3 protocol server on loopback (moto's server mode, tests/s3server.py). Nothing of fsspec, s3fs or boto is
mocked. One GPT run on the bucket serves every read: its local run.dir is a plain download of the bucket."""

import os
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import dtrain, ok

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
def prepared(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    shutil.copytree(stdlib / "json", corpus / "json", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("tokens") / "bpe"
    ok(dtrain("prepare", "text", str(corpus), "--out", str(out), "--vocab-size", "300", "--workers", "1"))
    return out


@pytest.fixture(scope="module")
def gpt_on_the_bucket(s3, prepared, tmp_path_factory):
    """(its URL, the same run.dir downloaded to a local folder, a machine's cache) of one GPT run."""
    tmp = tmp_path_factory.mktemp("gpt-url")
    url = s3.url("runs/gpt")
    ok(dtrain("run", *GPT, f"data.path={prepared}", f"run.dir={url}", extra_env=on(s3, tmp / "trainer")))
    local = tmp / "local"
    s3.filesystem().get(f"{s3.bucket}/runs/gpt/", str(local), recursive=True)
    os.utime(local / "model.safetensors")  # downloaded last: the final weights are the newest, as on the bucket
    return url, local, tmp / "reader"


def test_generate_and_report_on_the_bucket_say_what_they_say_on_the_local_run_dir(s3, gpt_on_the_bucket):
    url, local, reader = gpt_on_the_bucket
    sample = ["--prompt", "def ", "--tokens", "16", "--temperature", "0"]
    here, there = (
        ok(dtrain("generate", str(local), *sample)),
        ok(dtrain("generate", url, *sample, extra_env=on(s3, reader))),
    )
    assert here.stdout == there.stdout and len(there.stdout) > len("def ") and there.stderr == ""
    # A checkpoint prefix without COMPLETE.json (a write cut short) is never read, even where it is newer.
    s3.filesystem().pipe_file(f"{s3.bucket}/runs/gpt/checkpoints/step-9/state/__0_0.distcp", b"half")
    assert ok(dtrain("generate", url, *sample, extra_env=on(s3, reader))).stdout == here.stdout
    assert not [r for r in s3.requests() if r[0] == "GET" and "/step-9/" in r[1]]
    here, there = ok(dtrain("report", str(local))), ok(dtrain("report", url, extra_env=on(s3, reader)))
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


def test_export_from_the_bucket_equals_the_local_export_and_to_the_bucket_loads(s3, gpt_on_the_bucket, tmp_path):
    from dtrain.checkpoint.hf_export import export_hf  # the local exports: what `dtrain export` runs, here

    url, local, reader = gpt_on_the_bucket
    final, at_4 = export_hf(local, tmp_path / "final"), export_hf(local, tmp_path / "at-4", step=4)
    said = ok(dtrain("export", url, "--format", "hf", "--out", str(tmp_path / "url"), extra_env=on(s3, reader)))
    assert said.stdout.startswith(f"{tmp_path / 'url'}: the final weights of {url} as a Hugging Face model folder")
    same_export(final, tmp_path / "url")
    # --out on the bucket: config.json last, after every other object; downloaded, from_pretrained loads it.
    target, prefix = s3.url("exports/gpt"), f"{s3.bucket}/exports/gpt"
    said = ok(dtrain("export", url, "--format", "hf", "--step", "4", "--out", target, extra_env=on(s3, reader)))
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
    ok(dtrain("export", url, "--format", "hf", "--out", target, extra_env=on(s3, reader)))
    writes = [(m, p.split("?")[0]) for m, p, _ in s3.requests()[requests_before:] if m in ("PUT", "DELETE")]
    writes = [(m, p) for m, p in writes if "/exports/gpt/" in p]
    assert writes[0] == ("DELETE", f"/{prefix}/config.json") and writes[-1] == ("PUT", f"/{prefix}/config.json")
    s3.filesystem().get(f"{prefix}/", str(tmp_path / "down-final"), recursive=True)
    same_export(final, tmp_path / "down-final")


def test_a_run_dir_url_the_commands_cannot_read_is_one_line(s3, gpt_on_the_bucket, tmp_path):
    url, _, reader = gpt_on_the_bucket
    extra = on(s3, reader)
    one_line_refusal(
        dtrain("generate", "s3://no-such-bucket/run", extra_env=extra),
        "RUN_DIR = 's3://no-such-bucket/run': bucket 'no-such-bucket' does not exist",
    )
    one_line_refusal(
        dtrain("report", s3.url("runs/nothing-here"), extra_env=extra),
        f"RUN_DIR {s3.url('runs/nothing-here')} holds nothing",
    )
    one_line_refusal(
        dtrain("export", url, "--format", "hf", "--step", "9", extra_env=extra),
        f"{url} holds no complete checkpoint step-9 (complete ones: step-4, step-8)",
    )
    wrong = {**extra, "AWS_SECRET_ACCESS_KEY": "AKIAWRONGWRONGWRONG0"}
    one_line_refusal(
        dtrain("export", url, "--format", "hf", extra_env=wrong),
        f"RUN_DIR = '{url}': the store refused these credentials (",
    )
    s3.filesystem().pipe_file(f"{s3.bucket}/exports/theirs/notes.txt", b"mine")
    one_line_refusal(
        dtrain("export", url, "--format", "hf", "--out", s3.url("exports/theirs"), extra_env=extra),
        f"--out {s3.url('exports/theirs')} holds notes.txt, which an export does not write",
    )
    assert not list(reader.glob("dtrain/run-reads/read-*")) and not list(reader.glob("dtrain/run-reads/export-*"))
