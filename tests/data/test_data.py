"""Built-in data sets (digits, MNIST IDX, synthetic) and user factories."""

import numpy as np
import pytest
import torch

from dtrain import data, models
from dtrain.config import load_config
from dtrain.errors import ConfigError, DataError
from helpers import dtrain, fake_mnist, write_idx


@pytest.mark.parametrize("gz", [True, False])
def test_mnist_idx_files_plain_or_gzipped(tmp_path, gz):
    rng = np.random.default_rng(5)
    arrays = {
        "train": (rng.integers(0, 256, (30, 28, 28)), rng.integers(0, 10, 30)),
        "t10k": (rng.integers(0, 256, (10, 28, 28)), rng.integers(0, 10, 10)),
    }
    suffix = ".gz" if gz else ""
    for prefix, (images, labels) in arrays.items():
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte{suffix}", images)
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte{suffix}", labels)
    splits = data.build(load_config(None, ["data.name=mnist", f"data.path={tmp_path}"]))
    x, y = splits.train.tensors
    assert x.shape == (30, 1, 28, 28) and x.dtype == torch.float32
    # Against the arrays written, not against dtrain's own reader: ToTensor's scaling, 255 -> 1.0.
    assert torch.equal(x[:, 0], torch.from_numpy(arrays["train"][0].astype(np.float32) / 255))
    assert torch.equal(y, torch.from_numpy(arrays["train"][1]).long())
    ex, ey = splits.eval.tensors
    assert torch.equal(ey, torch.from_numpy(arrays["t10k"][1]).long()) and len(ex) == 10
    assert splits.num_classes == 10 and splits.input_shape == (1, 28, 28)


def test_mnist_in_torchvision_layout(tmp_path):
    fake_mnist(tmp_path / "MNIST" / "raw", n_train=8, n_test=4)
    assert len(data.build(load_config(None, ["data.name=mnist", f"data.path={tmp_path}"])).train) == 8


def test_mnist_missing_and_corrupt_files_are_named(tmp_path):
    cfg = load_config(None, ["data.name=mnist", f"data.path={tmp_path}"])
    with pytest.raises(
        DataError, match=f"data.path = '{tmp_path}' does not hold the MNIST IDX files.*data.download=true"
    ):
        data.build(cfg)
    with pytest.raises(DataError, match="does not hold the MNIST IDX files"):
        data.fetch(cfg)  # the launcher's check, before any worker starts
    fake_mnist(tmp_path, n_train=8, n_test=4, gz=False)
    images = tmp_path / "train-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:-100])
    with pytest.raises(DataError, match="train-images-idx3-ubyte is truncated or corrupt"):
        data.build(cfg)
    images.write_bytes(b"not an idx file at all")
    with pytest.raises(DataError, match="is not an IDX file"):
        data.build(cfg)
    write_idx(images, np.zeros((5, 28, 28)))  # 5 images for 8 labels
    with pytest.raises(DataError, match="has 8 labels for 5 images"):
        data.build(cfg)
    write_idx(images, np.zeros((8, 32, 32)))  # images of another size
    with pytest.raises(DataError, match=r"holds images of shape \[8, 32, 32\]; MNIST images are N×28×28"):
        data.check(cfg)  # the launcher's content check, before any worker starts
    write_idx(images, np.zeros((8, 28, 28)))
    write_idx(tmp_path / "train-labels-idx1-ubyte", [1, 2, 3, 200, 4, 5, 6, 7])  # a label no digit has
    with pytest.raises(DataError, match="holds label 200; MNIST labels are the digits 0-9"):
        data.check(cfg)


def test_a_failed_download_leaves_no_folder_it_made(tmp_path):
    """Nothing outside this machine answers: the download fails in one line, and the folders it made for the
    files are gone (an empty data/mnist would look like data that is there); a folder that was there stays."""
    from dtrain.data import mnist

    (tmp_path / "kept").mkdir()
    with pytest.raises(DataError, match=r"could not download train-images-idx3-ubyte\.gz into .*data/mnist"):
        mnist.download(tmp_path / "kept" / "data" / "mnist")
    assert [p.name for p in tmp_path.iterdir()] == ["kept"] and not any((tmp_path / "kept").iterdir())


def test_the_mnist_example_names_its_own_flags_when_the_files_are_missing(tmp_path):
    """examples/mnist_ddp.py is a script with --data and --download, not a config: its one line says those."""
    result = dtrain("launch", "--nproc", "1", "examples/mnist_ddp.py", "--data", str(tmp_path / "none"))
    assert result.returncode == 2 and result.stderr.splitlines() == [
        f"dtrain: error: --data = '{tmp_path / 'none'}' does not hold the MNIST IDX files (train-images-idx3-ubyte, "
        "train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, plain or .gz); put them there or "
        "pass --download"
    ], result.stderr


def test_an_empty_mnist_file_is_named_by_the_launcher(tmp_path):
    from helpers import dtrain as dtrain_cli

    fake_mnist(tmp_path, n_train=8, n_test=4, gz=False)
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(b"")
    result = dtrain_cli(
        "run", "examples/mnist_mlp.toml", "--nproc", "2", f"data.path={tmp_path}", f"run.dir={tmp_path / 'run'}"
    )
    assert result.returncode == 2 and result.stderr.strip() == (
        f"dtrain: error: {tmp_path / 'train-labels-idx1-ubyte'} is not an IDX file (bad header); replace it "
        f"with the original MNIST file"
    )


def test_digits_split_is_fixed_and_size_hint_agrees():
    cfg = load_config(None, [])
    a, b = data.build(cfg), data.build(load_config(None, ["run.seed=9"]))
    assert len(a.train) == data.size_hint(cfg) == 1438 and len(a.eval) == 359
    assert torch.equal(a.eval.tensors[1], b.eval.tensors[1])  # held-out split ignores run.seed
    assert float(a.train.tensors[0].max()) == 1.0 and a.input_shape == (64,)


def test_digits_are_scikit_learns_own_read_without_importing_it():
    """The file read in place of scikit-learn's loader (its import costs a worker ~1.5 s) gives the same
    rows and labels, in the same order."""
    from sklearn.datasets import load_digits

    from dtrain.data.datasets import digits_arrays

    pixels, labels = digits_arrays()
    theirs = load_digits()
    assert pixels.shape == (1797, 64) and np.array_equal(pixels, theirs.data)
    assert np.array_equal(labels, theirs.target) and labels.dtype == theirs.target.dtype


def test_synthetic_is_deterministic_and_shaped():
    cfg = load_config(
        None, ["data.name=synthetic", "data.num_samples=500", "data.input_shape=[1, 4, 4]", "data.num_classes=3"]
    )
    a, b = data.build(cfg), data.build(cfg)
    assert torch.equal(a.train.tensors[0], b.train.tensors[0])
    assert a.train.tensors[0].shape == (400, 1, 4, 4) and a.num_classes == 3
    assert set(a.train.tensors[1].tolist()) == {0, 1, 2}
    assert len(a.train) == data.size_hint(cfg)


def test_user_factories_for_data_and_model():
    cfg = load_config(
        None,
        ["data.name=user_factories:tiny_data", "model.name=user_factories:wide_model", "model.options={width = 5}"],
    )
    splits = data.build(cfg)
    assert (len(splits.train), len(splits.eval), splits.input_shape, splits.num_classes) == (64, 32, (6,), 4)
    model = models.build(cfg.model, splits.input_shape, splits.num_classes)
    assert model[0].out_features == 5


@pytest.mark.parametrize(
    "ref, message",
    [
        ("no_such_module:f", "cannot import module 'no_such_module'"),
        ("user_factories:missing", "module 'user_factories' has no function 'missing'"),
        ("user_factories:not_a_model", "returned str, not a torch.nn.Module"),
    ],
)
def test_bad_model_factories(ref, message):
    with pytest.raises(ConfigError, match=message):
        models.build(load_config(None, [f"model.name={ref}"]).model, (6,), 4)


@pytest.mark.parametrize(
    "factory, message",
    [
        ("returns_a_string", "returned str as its training set; it must return a map-style Dataset"),
        ("returns_a_number", "returned int as its training set; it must return a map-style Dataset"),
        ("returns_a_dict_without_train", "returned NoneType as its training set"),
        ("returns_an_empty_set", "returned an empty dataset as its training set"),
        ("returns_a_bad_eval_set", "returned int as its eval set"),
        ("returns_unreadable_samples", "its first training sample cannot be read as (input, label) (KeyError: "),
    ],
)
def test_data_factories_returning_the_wrong_kind_are_refused_in_one_line(factory, message):
    with pytest.raises(DataError) as refused:
        data.build(load_config(None, [f"data.name=user_factories:{factory}"]))
    assert str(refused.value).startswith(f"data.name = 'user_factories:{factory}'")
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_model_options_a_model_does_not_take():
    with pytest.raises(ConfigError, match="model.options has depth, which mlp\\(\\) does not take"):
        models.build(load_config(None, ["model.options={depth = 3}"]).model, (6,), 4)


def test_the_guides_mlp():
    model = models.build(load_config(None, []).model, (1, 28, 28), 10)
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    assert [(l.in_features, l.out_features) for l in linears] == [(784, 1024), (1024, 10)]
    assert isinstance(model[2], torch.nn.ReLU)
