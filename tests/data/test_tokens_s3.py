"""Token data on object storage: `data.path = s3://bucket/prefix` against a real S3 protocol server on
loopback (moto's server mode, tests/s3server.py), found by dtrain and its torchrun workers through boto's
usual environment, as a real store would be. Nothing of fsspec, s3fs or boto is mocked."""

import time

import pytest
import torch

from dtrain.data.batch import BatchGatherer
from dtrain.data.tokens import TokenWindows
from helpers import dtrain, env, eval_lines, ok, train_lines, weights

GPT = [
    "examples/gpt_stdlib.toml",
    "data.block_size=32",
    "data.batch_size=4",
    "data.eval_batch_size=16",
    "training.epochs=1",
    "training.max_steps=6",
    "training.log_every=1",
    "model.options={n_layer = 1, n_head = 2, n_embd = 32}",
    "scheduler.warmup_steps=2",
    "checkpoint.every_steps=0",
]


@pytest.fixture(scope="module")
def prepared(json_bpe_tokens):
    """`dtrain prepare text` output (a BPE tokenizer and shards of one standard-library package)."""
    return json_bpe_tokens


@pytest.fixture(scope="module")
def uploaded(s3, prepared):
    """The prepared folder copied into the bucket as it is; its URL."""
    return s3.upload(prepared, "tokens/json")


def test_windows_read_from_the_bucket_are_the_local_folders(s3, prepared, uploaded, monkeypatch):
    """Every window of both splits, read by ranged requests from the store, equals the memory map's."""
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    for split in ("train", "val"):
        local, remote = TokenWindows(prepared, split, 32), TokenWindows(uploaded, split, 32)
        assert len(local) == len(remote) > 8
        order = torch.randperm(len(local), generator=torch.Generator().manual_seed(0))
        for a, b in zip(local.take(order), remote.take(order)):
            assert torch.equal(a, b)
    # Only ranges of the shards were asked for, never a whole shard: no local copy of the data set.
    shard_gets = [r for r in s3.requests() if r[0] == "GET" and r[1].endswith(".bin")]
    assert shard_gets and all(status == 206 for _, _, status in shard_gets), shard_gets


@pytest.fixture(scope="module")
def runs(warm, s3, prepared, uploaded, tmp_path_factory):
    """The same 2-process GPT run on the local folder and on the bucket."""
    local, remote = tmp_path_factory.mktemp("local"), tmp_path_factory.mktemp("remote")
    ok(warm("run", *GPT, f"data.path={prepared}", f"run.dir={local}", "--nproc", "2"))
    result = ok(warm("run", *GPT, f"data.path={uploaded}", f"run.dir={remote}", "--nproc", "2", extra_env=s3.env))
    return local, remote, result


def test_a_run_on_the_bucket_trains_bitwise_as_on_the_local_folder(runs):
    """The same tokens in the same order give the same computation on the same 2 CPU processes: losses,
    eval losses and final weights are bitwise equal, not merely close."""
    local, remote, _ = runs
    assert [m["loss"] for m in train_lines(local)] == [m["loss"] for m in train_lines(remote)]
    a, b = weights(local), weights(remote)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    evals = [[m["eval_loss"] for m in eval_lines(d)] for d in (local, remote)]
    assert evals[0] == evals[1] and evals[0]
    # The tokenizer kept beside the weights (what `dtrain generate` decodes with) came from the bucket.
    for name in ("meta.json", "tokenizer.json"):
        assert (remote / "tokenizer" / name).read_bytes() == (local / "tokenizer" / name).read_bytes()


def test_the_credentials_are_written_nowhere(s3, uploaded, runs):
    """config.toml records the URL; neither the key's secret nor the key id is in any file of run.dir, nor
    on the console."""
    _, remote, result = runs
    assert f'path = "{uploaded}"' in (remote / "config.toml").read_text()
    files = [p for p in remote.rglob("*") if p.is_file()]
    assert any(p.name == "metrics.jsonl" for p in files)
    for secret in (s3.secret, s3.key):
        assert secret not in result.stdout + result.stderr
        assert not [p for p in files if secret.encode() in p.read_bytes()]


HIDE_S3FS = """\
import sys


class HideS3fs:
    # As if the s3 extra were not installed: `import s3fs` fails as it would then.
    def find_spec(self, name, path=None, target=None):
        if name == "s3fs" or name.startswith("s3fs."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


sys.meta_path.insert(0, HideS3fs())
"""


@pytest.mark.parametrize(
    "case",
    [
        "no bucket",
        "bad bucket name",
        "no meta.json",
        "wrong secret",
        "unknown key",
        "no credentials",
        "no s3fs",
        "password in URL",
        "password with a slash in URL",
    ],
)
def test_a_store_that_cannot_serve_the_data_is_one_line_from_the_launcher(s3, uploaded, tmp_path, case):
    """Refused before any worker starts: exit 2, one line naming the URL and what would work, the secret
    nowhere, run.dir not even created."""
    url, extra = uploaded, dict(s3.env)
    if case == "no bucket":
        url = "s3://no-such-bucket/tokens"
        expected = "data.path = 's3://no-such-bucket/tokens': bucket 'no-such-bucket' does not exist"
    elif case == "bad bucket name":
        url = "s3://bad bucket!/tokens"
        expected = f"data.path = '{url}' is not a usable URL (Invalid bucket name \"bad bucket!\"); e.g. s3://"
    elif case == "no meta.json":
        url = s3.url("nothing/here")
        expected = f"{url}/meta.json does not exist: data.path must be a prefix holding the files `dtrain prepare"
    elif case in ("wrong secret", "unknown key"):
        extra["AWS_SECRET_ACCESS_KEY" if case == "wrong secret" else "AWS_ACCESS_KEY_ID"] = "AKIAWRONGWRONGWRONG0"
        expected = f"data.path = '{url}': the store refused these credentials ("
    elif case == "no credentials":
        del extra["AWS_ACCESS_KEY_ID"], extra["AWS_SECRET_ACCESS_KEY"]
        expected = f"data.path = '{url}': no credentials for the store were found; check AWS_ACCESS_KEY_ID"
    elif case == "no s3fs":
        hide = tmp_path / "hide"
        hide.mkdir()
        (hide / "sitecustomize.py").write_text(HIDE_S3FS)
        extra["PYTHONPATH"] = f"{hide}:{env()['PYTHONPATH']}"
        expected = f"data.path = '{url}' needs the s3:// protocol, which is not installed; pip install 'dtrain[s3]'"
    else:  # the secret as the server made it, and one holding '/' as S3 secrets often do
        secret = s3.secret if case == "password in URL" else "wJalrXUt/EXAMPLE+KEY"
        url = url.replace("s3://", f"s3://{s3.key}:{secret}@")
        expected = f"data.path = '{uploaded}' carries a password in the URL"
    run_dir = tmp_path / "run"
    result = dtrain("run", *GPT, f"data.path={url}", f"run.dir={run_dir}", "--nproc", "2", extra_env=extra)
    lines = (result.stdout + result.stderr).splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("dtrain: error: " + expected), lines
    assert s3.secret not in lines[0] and "EXAMPLE" not in lines[0] and not run_dir.exists()


class SlowStore(BatchGatherer):
    """A data set whose `take` stands for a store's round trip; it records when each batch was asked for."""

    read_ahead = True

    def __init__(self):
        self.asked: list[int] = []

    def take(self, indices: torch.Tensor) -> torch.Tensor:
        self.asked.append(int(indices[0]))
        return indices.clone()


def test_object_storage_reads_one_batch_ahead_and_never_more():
    """The next batch is asked for while the caller holds this one (the read-ahead), never two ahead, and
    the batches come in the same order as without it."""
    from dtrain.config import DataConfig
    from dtrain.data.loaders import _source_for

    store = SlowStore()
    batches = _source_for(store, DataConfig(), torch.device("cpu"), None).batches(torch.arange(40), 4)
    got = []
    for k, batch in enumerate(batches):
        got.append(batch)
        assert len(store.asked) <= k + 2  # batch k, and at most batch k + 1 in flight
        if k == 3:  # held a while: the thread asks for batch k + 1 meanwhile, and for no more
            for _ in range(500):
                if len(store.asked) == k + 2:
                    break
                time.sleep(0.01)
            time.sleep(0.05)
            assert len(store.asked) == k + 2
    assert torch.equal(torch.cat(got), torch.arange(40)) and store.asked == list(range(0, 40, 4))


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.init_from=s3://bucket/weights", "model.init_from = 's3://bucket/weights'"),
        ("model.name=hf:s3://KEY:SECRET@bucket/model", "model.name = 'hf:s3://bucket/model'"),
        (
            "checkpoint.resume_from=s3://bucket/run/checkpoints/step-5",
            "checkpoint.resume_from = 's3://bucket/run/checkpoints/step-5'",
        ),
    ],
)
def test_a_url_where_only_local_paths_are_read_is_refused_in_one_line(override, key, tmp_path, monkeypatch):
    """Only data.path and run.dir read object storage: a URL for the weights was taken for a local path
    (pathlib makes "s3://b/p" the folder "s3:/b/p") and must be refused instead."""
    from dtrain.config import load_config
    from dtrain.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as error:
        load_config(None, [override])
    said = f"{key} holds a URL, and dtrain reads object storage only for data.path and run.dir"
    assert str(error.value).startswith(said)
    assert "SECRET" not in str(error.value) and not any(tmp_path.iterdir())


def test_dtrain_export_refuses_a_url_carrying_a_password_in_one_line(tmp_path):
    """RUN_DIR and --out may be URLs (tests/commands/test_run_dir_url.py), but never with a secret in them."""
    for args, said in (
        (["s3://KEY:SE/CRET@bucket/run"], "RUN_DIR s3://bucket/run carries a password in the URL"),
        ([str(tmp_path), "--out", "s3://KEY:SE/CRET@bucket/hf"], "--out s3://bucket/hf carries a password in the URL"),
    ):
        result = dtrain("export", *args, "--format", "hf", cwd=tmp_path)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
        assert (
            result.stderr.startswith(f"dtrain: error: {said}; give the store's credentials")
            and "SE/CRET" not in result.stderr
        )
    assert not any(tmp_path.iterdir())
