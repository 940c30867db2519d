"""Property-based fuzzing (hypothesis): whatever a user or a damaged file hands dtrain, the answer is a
one-line DtrainError (exit status 2 at the command line) or success — never another exception (a
traceback), never a file changed outside the folder the command owns. Seeded and bounded, so the suite
stays fast and every run tries the same cases."""

import contextlib
import json
import shutil
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dtrain
from dtrain.checkpoint import preflight as checkpoint_preflight
from dtrain.config import Config, all_keys, load_config
from dtrain.data import mnist
from dtrain.errors import DtrainError
from dtrain.report import build_figures, load_records, summary



def fuzz(examples: int):
    """Seeded (the same cases every run), bounded, no example database left in the tree."""
    return settings(max_examples=examples, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

toml_ish = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(lambda f: repr(f).replace("inf", "inf")),
    st.sampled_from(["true", "false", "nan", "-inf", "[]", "[1, 2]", "[0.9, 0.999]", "{}", "{a = 1}", '""', "''",
                     "[[1]]", "1e400", "0x10", "1_000", "'x'", "\"digits\"", "auto", "-0"]),
    st.text(alphabet=string.printable, max_size=12),
)


@fuzz(300)
@given(key=st.one_of(st.sampled_from(all_keys()), st.text(alphabet=string.ascii_letters + "._", max_size=20)),
       value=toml_ish)
def test_any_override_is_accepted_or_refused_in_one_line(key, value):
    try:
        config = load_config(None, [f"{key}={value}"])
    except DtrainError as exc:
        assert "\n" not in str(exc) and str(exc)
        return
    Config.from_dict(config.to_dict())  # what was accepted also round-trips through config.toml


def tree(folder):
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


@fuzz(60)
@given(key=st.one_of(st.sampled_from(all_keys()), st.just("run.dir")), value=toml_ish)
def test_the_launchers_checks_change_nothing_outside_run_dir(tmp_path_factory, key, value):
    """Any override through the launcher's checks (config, run.dir, data, checkpoints): refused in one
    line or passed, and no file outside run.dir created, changed or removed."""
    from dtrain.job import preflight

    home = tmp_path_factory.mktemp("cwd")
    (home / "notes.txt").write_text("mine")
    (home / "runs" / "old").mkdir(parents=True)
    before = tree(home)
    with contextlib.chdir(home):
        try:
            config = load_config(None, ["data.download=false", f"{key}={value}"])
            preflight(config, world_size=1, local_world_size=1)
        except DtrainError as exc:
            assert "\n" not in str(exc) and str(exc)
            config = None
        run_dir = (home / config.run.dir).resolve() if config else None
    after = tree(home)
    changed = {name for name in before.keys() | after.keys() if before.get(name, 0) != after.get(name, 0)}
    outside = [n for n in changed if run_dir is None or not (home / n).resolve().is_relative_to(run_dir)]
    assert outside == [], outside


@fuzz(200)
@given(raw=st.dictionaries(st.sampled_from(["run", "data", "training", "optimizer", "model", "bogus"]),
                           st.one_of(st.dictionaries(st.text(max_size=15), st.one_of(
                               st.integers(), st.floats(), st.text(max_size=8), st.booleans(),
                               st.lists(st.integers(), max_size=3))), st.integers(), st.text(max_size=5)),
                           max_size=4))
def test_any_config_file_content_is_accepted_or_refused_in_one_line(raw):
    try:
        Config.from_dict(raw, source="fuzz.toml")
    except DtrainError as exc:
        assert "\n" not in str(exc)


@fuzz(80)
@given(lines=st.lists(st.one_of(
    st.text(max_size=40),
    st.binary(max_size=40).map(lambda b: b.decode("latin-1")),
    st.dictionaries(st.sampled_from(["step", "loss", "epoch", "samples_per_s", "eval_loss", "rank_busy_ms",
                                     "data_ms", "compute_ms", "comm_ms", "optimizer_ms", "stragglers"]),
                    st.one_of(st.integers(), st.floats(), st.text(max_size=4), st.none(),
                              st.lists(st.floats(), max_size=3))).map(json.dumps),
    st.just(json.dumps({"step": 1, "loss": 0.5, "epoch": 0, "samples_per_s": 10.0}))), max_size=8))
def test_any_metrics_file_is_reported_or_refused_in_one_line(tmp_path_factory, lines):
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "metrics.jsonl").write_text("\n".join(lines), encoding="utf-8", errors="surrogateescape")
    import matplotlib.pyplot as plt

    try:
        records = load_records(run_dir)
        build_figures(records)
        summary(records)
    except DtrainError as exc:
        assert "\n" not in str(exc)
    finally:
        plt.close("all")
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]


@pytest.fixture(scope="module")
def a_checkpoint(tmp_path_factory):
    import torch
    from torch.utils.data import TensorDataset

    run_dir = tmp_path_factory.mktemp("checkpointed")
    config = Config.from_dict({"run": {"dir": str(run_dir)}, "data": {"batch_size": 8},
                               "training": {"epochs": 1, "stop_at_step": 2}})
    torch.manual_seed(0)
    x = torch.randn(40, 4)
    dtrain.Trainer(config, model=torch.nn.Linear(4, 2), train_data=TensorDataset(x, (x[:, 0] > 0).long())).fit()
    return run_dir


@fuzz(120)
@given(marker=st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=6)),
                           lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                   st.dictionaries(st.sampled_from(
                                                       ["step", "files", "world_size", "bytes", "crc32",
                                                        "trainer.json", "state/.metadata"]), inner, max_size=4)),
                           max_leaves=10))
def test_any_checkpoint_marker_is_trusted_or_refused_in_one_line(a_checkpoint, tmp_path_factory, marker):
    run_dir = tmp_path_factory.mktemp("copy")
    shutil.copytree(a_checkpoint / "checkpoints", run_dir / "checkpoints")
    (run_dir / "checkpoints" / "step-2" / "COMPLETE.json").write_text(json.dumps(marker))
    config = Config.from_dict({"run": {"dir": str(run_dir)}})
    try:
        checkpoint_preflight(config, run_dir, world_size=1, global_order=False)
    except DtrainError as exc:
        assert "\n" not in str(exc)


@fuzz(300)
@given(header=st.binary(max_size=24), body=st.binary(max_size=64))
def test_any_idx_file_is_read_or_refused_in_one_line(tmp_path_factory, header, body):
    path = tmp_path_factory.mktemp("idx") / "train-images-idx3-ubyte"
    path.write_bytes(header + body)
    try:
        mnist.read_idx(path)
    except DtrainError as exc:
        assert "\n" not in str(exc)


@fuzz(150)
@given(meta=st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8)),
                         lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(
                             ["format", "dtype", "vocab_size", "splits", "train", "val", "files", "tokens",
                              "tokenizer"]), inner, max_size=5)), max_leaves=12),
       shape=st.sampled_from(["as is", "dtrain-tokens"]))
def test_any_token_meta_json_is_read_or_refused_in_one_line(tmp_path_factory, meta, shape):
    from dtrain.data.tokens import read_meta

    folder = tmp_path_factory.mktemp("tokens")
    (folder / "train-00000.bin").write_bytes(b"\0\1" * 10)
    if shape == "dtrain-tokens" and isinstance(meta, dict):  # get past the first check more often
        meta = {"format": "dtrain-tokens", "dtype": "uint16", **meta}
    (folder / "meta.json").write_text(json.dumps(meta))
    try:
        read_meta(folder)
    except DtrainError as exc:
        assert "\n" not in str(exc)
