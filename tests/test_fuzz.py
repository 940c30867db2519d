"""Property-based fuzzing (hypothesis): whatever a user or a damaged file hands dtrain, the answer is a
one-line DtrainError (exit status 2 at the command line) or success — never another exception (a
traceback), never a file changed outside the folder the command owns. Seeded and bounded, so the suite
stays fast and every run tries the same cases."""

import contextlib
import json
import shutil
import string
import typing

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import dtrain
from dtrain.commands.report import build_figures, load_records, summary
from dtrain.config import Config, all_keys, load_config, tomllib
from dtrain.data import mnist
from dtrain.errors import DtrainError
from dtrain.rundir.resume_point import finished
from dtrain.rundir.resume_point import preflight as checkpoint_preflight
from helpers import ROOT
from helpers import dtrain as run_dtrain


def fuzz(examples: int):
    """Seeded (the same cases every run), bounded, no example database left in the tree."""
    return settings(
        max_examples=examples,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


toml_ish = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(lambda f: repr(f).replace("inf", "inf")),
    st.sampled_from(
        [
            "true",
            "false",
            "nan",
            "-inf",
            "[]",
            "[1, 2]",
            "[0.9, 0.999]",
            "{}",
            "{a = 1}",
            '""',
            "''",
            "[[1]]",
            "1e400",
            "0x10",
            "1_000",
            "'x'",
            '"digits"',
            "auto",
            "-0",
        ]
    ),
    st.text(alphabet=string.printable, max_size=12),
)


@fuzz(300)
@given(
    key=st.one_of(st.sampled_from(all_keys()), st.text(alphabet=string.ascii_letters + "._", max_size=20)),
    value=toml_ish,
)
def test_any_override_is_accepted_or_refused_in_one_line(key, value):
    try:
        config = load_config(None, [f"{key}={value}"])
    except DtrainError as exc:
        assert "\n" not in str(exc) and str(exc)
        return
    Config.from_dict(config.to_dict())  # what was accepted also round-trips through config.toml


def _keys_of(*kinds) -> list[str]:
    """Every key whose type is one of `kinds` (typing.Literal standing for any choice)."""
    from dtrain.config import SECTIONS

    config = Config()
    return [
        f"{s}.{name}"
        for s in SECTIONS
        for name, kind in typing.get_type_hints(type(getattr(config, s))).items()
        if kind in kinds or typing.get_origin(kind) in kinds
    ]


_STR_KEYS = _keys_of(str)


@fuzz(300)
@given(
    key=st.sampled_from(_keys_of(str, typing.Literal)),
    text=st.text(alphabet=string.ascii_letters + string.digits + " /._-:[]{}#=,~$@", max_size=16).map(str.strip),
    quote=st.sampled_from(['"', "'"]),
)
def test_a_quoted_override_is_the_text_between_its_quotes(key, text, quote):
    """key="text" and key='text' (TOML strings) mean what key=text means, when text is text (a number or
    true typed into a choice is not: training.compile=true means blocks, "true" is no choice); where text
    with a stray bracket is refused unquoted, quoted it is a value like any other."""
    with contextlib.suppress(tomllib.TOMLDecodeError):
        assume(key in _STR_KEYS or isinstance(tomllib.loads(f"v = {text}")["v"], str))
    try:
        plain: Config | str = load_config(None, [f"{key}={text}"])
    except DtrainError as exc:
        plain = str(exc)
    try:
        quoted: Config | str = load_config(None, [f"{key}={quote}{text}{quote}"])
    except DtrainError as exc:
        assert "\n" not in str(exc) and "on the command line:" not in str(exc), str(exc)
        quoted = str(exc)
    if isinstance(plain, Config) or "on the command line:" not in plain:
        assert quoted == plain


def extremes() -> list[tuple[str, str]]:
    """(key, value) for every numeric setting at the ends of what it accepts: its bounds, else the
    largest 64-bit integer or 32-bit float."""
    import dataclasses
    import typing

    from dtrain.config import SECTIONS

    config, pairs = Config(), []
    for section in SECTIONS:
        hints = typing.get_type_hints(type(getattr(config, section)))
        for f in dataclasses.fields(getattr(config, section)):
            kind = hints[f.name]
            if kind not in (int, float):
                continue
            lo, hi, above = (f.metadata.get(k) for k in ("min", "max", "above"))
            top = hi if hi is not None else (2**63 - 1 if kind is int else 3.4e38)
            bottom = lo if lo is not None else (above + (1 if kind is int else 1e-30) if above is not None else None)
            pairs += [(f"{section}.{f.name}", repr(kind(v))) for v in (top, bottom) if v is not None]
    return pairs


# Keys whose largest values are real work rather than a wrong answer (a model of 2^20 hidden units, the
# synthetic set's 2^31 samples): the launcher's size checks and the out-of-memory advice cover them.
_HEAVY = {"model.hidden_size", "data.num_samples", "data.block_size"}


@pytest.mark.parametrize("pair", [p for p in extremes() if p[0] not in _HEAVY], ids="=".join)
def test_every_value_the_config_accepts_trains_or_is_refused_in_one_line(tmp_path_factory, pair):
    """What validation lets through must be usable: a real step of training with the key at either end
    of its accepted range either runs or ends in one line — never a traceback, never nan in silence."""
    import torch
    from torch.utils.data import TensorDataset

    key, value = pair
    run_dir = tmp_path_factory.mktemp("extreme")
    try:
        config = load_config(
            None,
            [
                f"run.dir={run_dir}",
                "training.epochs=1",
                "training.max_steps=2",
                "data.batch_size=8",
                "monitor.trackers=[]",
                "monitor.flops=no",
                "data.name=synthetic",
                f"{key}={value}",
            ],
        )
        torch.manual_seed(0)
        x = torch.randn(40, 4)
        dtrain.Trainer(
            config,
            model=torch.nn.Linear(4, 2),
            train_data=TensorDataset(x, (x[:, 0] > 0).long()),
            eval_data=TensorDataset(x[:8], (x[:8, 0] > 0).long()),
        ).fit()
    except DtrainError as exc:
        assert "\n" not in str(exc) and str(exc)


@fuzz(12)
@given(key=st.sampled_from(all_keys()), value=toml_ish)
def test_the_command_line_answers_any_override_with_success_or_one_line_and_exit_2(tmp_path_factory, key, value):
    """The whole path a user takes — `dtrain run` with one random override on a tiny job — ends with
    exit 0, or exit 2 and one line; never a traceback, and nothing outside run.dir changes."""
    home = tmp_path_factory.mktemp("cli")
    (home / "notes.txt").write_text("mine")
    before = tree(home)
    result = run_dtrain(
        "run",
        str(ROOT / "examples" / "digits_mlp.toml"),
        "training.epochs=1",
        "training.max_steps=3",
        "monitor.trackers=[]",
        "monitor.flops=no",
        f"{key}={value}",
        "run.dir=run",
        cwd=home,
    )
    # A note (a setting that does nothing here) may come first: the answer is the one line after it.
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("note: ")]
    if result.returncode != 0:
        assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("dtrain: error: "), result.stderr
    assert "Traceback" not in result.stderr
    after = tree(home)
    changed = {n for n in before.keys() | after.keys() if before.get(n, 0) != after.get(n, 0)}
    assert all(n == "run" or n.startswith("run/") for n in changed), changed


def tree(folder):
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


@fuzz(60)
@given(key=st.one_of(st.sampled_from(all_keys()), st.just("run.dir")), value=toml_ish)
def test_the_launchers_checks_change_nothing_outside_run_dir(tmp_path_factory, key, value):
    """Any override through the launcher's checks (config, run.dir, data, checkpoints): refused in one
    line or passed, and no file outside run.dir created, changed or removed."""
    from dtrain.launch.preflight import preflight

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
@given(
    raw=st.dictionaries(
        st.sampled_from(["run", "data", "training", "optimizer", "model", "bogus"]),
        st.one_of(
            st.dictionaries(
                st.text(max_size=15),
                st.one_of(
                    st.integers(), st.floats(), st.text(max_size=8), st.booleans(), st.lists(st.integers(), max_size=3)
                ),
            ),
            st.integers(),
            st.text(max_size=5),
        ),
        max_size=4,
    )
)
def test_any_config_file_content_is_accepted_or_refused_in_one_line(raw):
    try:
        Config.from_dict(raw, source="fuzz.toml")
    except DtrainError as exc:
        assert "\n" not in str(exc)


@fuzz(80)
@given(
    lines=st.lists(
        st.one_of(
            st.text(max_size=40),
            st.binary(max_size=40).map(lambda b: b.decode("latin-1")),
            st.dictionaries(
                st.sampled_from(
                    [
                        "step",
                        "loss",
                        "epoch",
                        "samples_per_s",
                        "eval_loss",
                        "rank_busy_ms",
                        "data_ms",
                        "compute_ms",
                        "comm_ms",
                        "optimizer_ms",
                        "stragglers",
                    ]
                ),
                st.one_of(
                    st.integers(), st.floats(), st.text(max_size=4), st.none(), st.lists(st.floats(), max_size=3)
                ),
            ).map(json.dumps),
            st.just(json.dumps({"step": 1, "loss": 0.5, "epoch": 0, "samples_per_s": 10.0})),
        ),
        max_size=8,
    )
)
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
    config = Config.from_dict(
        {"run": {"dir": str(run_dir)}, "data": {"batch_size": 8}, "training": {"epochs": 1, "stop_at_step": 2}}
    )
    torch.manual_seed(0)
    x = torch.randn(40, 4)
    dtrain.Trainer(config, model=torch.nn.Linear(4, 2), train_data=TensorDataset(x, (x[:, 0] > 0).long())).fit()
    return run_dir


@fuzz(120)
@given(
    marker=st.recursive(
        st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=6)),
        lambda inner: st.one_of(
            st.lists(inner, max_size=3),
            st.dictionaries(
                st.sampled_from(
                    [
                        "step",
                        "files",
                        "world_size",
                        "bytes",
                        "crc32",
                        "trainer.json",
                        "state/.metadata",
                        "plan",
                        "steps",
                    ]
                ),
                inner,
                max_size=4,
            ),
        ),
        max_leaves=10,
    )
)
def test_any_checkpoint_marker_is_trusted_or_refused_in_one_line(a_checkpoint, tmp_path_factory, marker):
    run_dir = tmp_path_factory.mktemp("copy")
    shutil.copytree(a_checkpoint / "checkpoints", run_dir / "checkpoints")
    (run_dir / "checkpoints" / "step-2" / "COMPLETE.json").write_text(json.dumps(marker))
    (run_dir / "model.safetensors").write_bytes(b"")  # weights there: the run could be found finished
    config = Config.from_dict({"run": {"dir": str(run_dir)}})
    try:
        said = finished(config, run_dir, world_size=1, n_train=40, global_order=False)
        assert said is None or "\n" not in said
        checkpoint_preflight(config, run_dir, world_size=1, global_order=False)
    except DtrainError as exc:
        assert "\n" not in str(exc)


_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 2**40), st.floats(), st.text(max_size=6)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8,
)


@fuzz(40)
@given(
    field=st.sampled_from(
        [
            "step",
            "epoch",
            "world_size",
            "samples_per_step",
            "optimizer",
            "scheduler",
            "scaler",
            "identity",
            "unscheduled_skips",
            None,
        ]
    ),
    value=_json,
)
def test_any_trainer_state_sealed_into_a_checkpoint_resumes_or_is_refused_in_one_line(
    a_checkpoint, tmp_path_factory, field, value
):
    """trainer.json edited (one field replaced, or the whole file) and the marker resealed to match, as a
    careless tool might: the resume either works or is refused in one line, never a traceback."""
    import zlib

    import torch
    from torch.utils.data import TensorDataset

    run_dir = tmp_path_factory.mktemp("resealed")
    shutil.copytree(a_checkpoint / "checkpoints", run_dir / "checkpoints")
    folder = run_dir / "checkpoints" / "step-2"
    trainer = json.loads((folder / "trainer.json").read_text())
    data = json.dumps(value if field is None else {**trainer, field: value}).encode()
    (folder / "trainer.json").write_bytes(data)
    marker = json.loads((folder / "COMPLETE.json").read_text())
    marker["files"]["trainer.json"] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    (folder / "COMPLETE.json").write_text(json.dumps(marker))
    config = Config.from_dict(
        {
            "run": {"dir": str(run_dir)},
            "data": {"batch_size": 8},
            "training": {"epochs": 1},
            "monitor": {"trackers": []},
        }
    )
    torch.manual_seed(0)
    x = torch.randn(40, 4)
    try:
        dtrain.Trainer(config, model=torch.nn.Linear(4, 2), train_data=TensorDataset(x, (x[:, 0] > 0).long())).fit()
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
@given(
    meta=st.recursive(
        st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8)),
        lambda inner: st.one_of(
            st.lists(inner, max_size=3),
            st.dictionaries(
                st.sampled_from(
                    ["format", "dtype", "vocab_size", "splits", "train", "val", "files", "tokens", "tokenizer"]
                ),
                inner,
                max_size=5,
            ),
        ),
        max_leaves=12,
    ),
    shape=st.sampled_from(["as is", "dtrain-tokens"]),
)
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
