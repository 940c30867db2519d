"""Checkpoints as named parts: a registered one (an EMA of the weights) resumed bitwise under the real
torchrun; the format number every compatibility branch asks."""

from __future__ import annotations

import json
import re
import shutil
import zlib

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.utils.data import TensorDataset

import dtrain
from dtrain.checkpoint import formats
from dtrain.checkpoint.manifest import MARKER
from dtrain.checkpoint.store import CheckpointError
from helpers import WORKERS, ok, weights


@pytest.fixture(scope="module")
def ema_runs(warm_torchrun, tmp_path_factory):
    out = tmp_path_factory.mktemp("ema")
    result = ok(warm_torchrun(WORKERS / "ema_parts.py", out, nproc=2))
    return out, json.loads((out / "results.json").read_text()), result.stderr


def test_a_registered_ema_resumes_bitwise(ema_runs):
    """Stopped at step 7 and resumed with an EMA begun from other weights: the final EMA is the very one
    of the run never stopped; resumed without registering it, the EMA is not."""
    out, results, _ = ema_runs
    assert results["updates"] == [18, 18]
    assert results["resumed_equal"] is True
    assert results["unregistered_equal"] is False  # the checkpoint's EMA is what made them equal
    folder = out / "unregistered" / "checkpoints" / "step-7"
    trainer = json.loads((folder / "trainer.json").read_text())
    assert trainer["parts"] == ["model", "optimizer", "scheduler", "scaler", "ema", "rng"]
    assert trainer["ema"] == {"decay": 0.8, "updates": 7, "shadow": {}}  # its tensors are DCP's
    saved = FileSystemReader(folder / "state").read_metadata().state_dict_metadata
    assert {"ema.shadow.0.weight", "ema.shadow.2.bias"} <= set(saved)
    assert trainer["format"] == json.loads((folder / MARKER).read_text())["format"] == formats.CURRENT


def test_a_part_registered_or_not_on_one_side_only_is_said(ema_runs):
    out, _, stderr = ema_runs
    lines = stderr.splitlines()
    assert (
        "checkpoint step-7 holds part 'ema' that this run did not register (Trainer.register_for_checkpointing): "
        "left unread"
    ) in lines
    assert (
        "checkpoint step-7 holds no part 'ema' (registered for checkpointing here): it keeps the state it has "
        "now, not a resumed one"
    ) in lines
    assert sum("holds no part" in line for line in lines) == 1  # said once, by rank 0
    resumed = json.loads((out / "plain" / "checkpoints" / "step-9" / "trainer.json").read_text())
    assert "ema" in resumed["parts"] and resumed["ema"]["updates"] == 2


def test_a_part_value_neither_tensor_nor_json_is_refused_at_the_first_save(ema_runs):
    out, results, _ = ema_runs
    assert results["refused"] == (
        "checkpoint step-2 cannot be written: part 'odd' key 'on_step' is neither a tensor nor JSON (Object of "
        "type builtin_function_or_method is not JSON serializable); make its state_dict() hold tensors, numbers, "
        "strings, lists and dicts only"
    )
    assert not (out / "refused" / "checkpoints").exists() or not any((out / "refused" / "checkpoints").iterdir())


def test_a_part_may_not_take_a_name_every_checkpoint_uses(tmp_path):
    """Refused when registered, before anything is written: a built-in part's or trainer.json's name, a
    dotted name (its tensors would collide with another part's: `model.0` with the model's), no name."""
    trainer = dtrain.Trainer(_config(tmp_path), model=_model(), train_data=_data())
    optimizer = torch.optim.SGD([torch.zeros(1)])
    for name in ("step", "model", "rng", "model.0", ""):
        with pytest.raises(
            dtrain.DtrainError, match=r"^register_for_checkpointing\(.*=...\): a part's name is a plain"
        ):
            trainer.register_for_checkpointing(**{name: optimizer})
    with pytest.raises(dtrain.DtrainError, match=r"got the class SGD, not an object of it"):
        trainer.register_for_checkpointing(sgd=torch.optim.SGD)
    assert trainer.checkpoint_parts == {}
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


# --- the format number ------------------------------------------------------------------------------


def _config(run_dir, **training):
    return dtrain.Config.from_dict(
        {
            "run": {"dir": str(run_dir), "seed": 1},
            "data": {"batch_size": 8},
            "optimizer": {"name": "adamw", "lr": 0.01},
            "training": {"epochs": 2, "log_every": 5, **training},
            "monitor": {"trackers": []},
        }
    )


def _model():
    torch.manual_seed(4)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _data():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(48, 6, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A one-process run of 12 steps stopped at step 5, and the weights of the same run never stopped."""
    base = tmp_path_factory.mktemp("format")
    dtrain.Trainer(_config(base / "whole"), model=_model(), train_data=_data()).fit()
    dtrain.Trainer(_config(base / "run", stop_at_step=5), model=_model(), train_data=_data()).fit()
    return base


def _rewrite(folder, change_trainer, change_marker):
    trainer = json.loads((folder / "trainer.json").read_text())
    change_trainer(trainer)
    data = json.dumps(trainer).encode()
    (folder / "trainer.json").write_bytes(data)
    marker = json.loads((folder / MARKER).read_text())
    change_marker(marker)
    marker["files"]["trainer.json"] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    (folder / MARKER).write_text(json.dumps(marker))


def test_a_checkpoint_without_a_format_number_is_format_2_and_resumes_bitwise(stopped, tmp_path):
    """Before the number, checkpoints kept DCP's nested names and the same trainer.json less its parts list:
    read as format 2, they resume to the weights of the run never stopped."""
    run_dir = tmp_path / "run"
    shutil.copytree(stopped / "run", run_dir)
    _rewrite(run_dir / "checkpoints" / "step-5", lambda t: [t.pop("format"), t.pop("parts")], lambda m: m.pop("format"))
    dtrain.Trainer(_config(run_dir), model=_model(), train_data=_data()).fit()
    resumed, expected = weights(run_dir), weights(stopped / "whole")
    assert resumed.keys() == expected.keys() and all(torch.equal(resumed[k], expected[k]) for k in expected)


@pytest.mark.parametrize("where", ["both", "trainer.json"])
def test_a_checkpoint_of_a_newer_format_is_refused_in_one_line(stopped, tmp_path, where):
    run_dir = tmp_path / "run"
    shutil.copytree(stopped / "run", run_dir)
    newer = formats.CURRENT + 1
    _rewrite(
        run_dir / "checkpoints" / "step-5",
        lambda t: t.update(format=newer),
        lambda m: m.update(format=newer) if where == "both" else None,
    )
    with pytest.raises(CheckpointError) as caught:
        dtrain.Trainer(_config(run_dir), model=_model(), train_data=_data()).fit()
    assert str(caught.value) == (
        f"checkpoint step-5 was written by a newer dtrain (checkpoint format {newer}; this one reads up to "
        f"{formats.CURRENT}): resume it with that dtrain or a later one, or start a new run.dir"
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: t.update(format=2), r"format 2, not a whole number >= 3"),
        (lambda t: t["parts"].remove("scheduler"), r"it names no scheduler part"),
        (lambda t: t.pop("unscheduled_skips"), r"unscheduled_skips is None, not a whole number >= 0"),
    ],
)
def test_a_numbered_trainer_json_is_judged_by_its_number(stopped, tmp_path, change, message):
    """From format 3 on, what the earlier formats could lack must be there; a number that was never written
    is not trusted to pick a layout."""
    run_dir = tmp_path / "run"
    shutil.copytree(stopped / "run", run_dir)
    _rewrite(run_dir / "checkpoints" / "step-5", change, lambda m: None)
    with pytest.raises(CheckpointError) as caught:
        dtrain.Trainer(_config(run_dir), model=_model(), train_data=_data()).fit()
    assert "\n" not in str(caught.value)
    assert re.search(r"trainer.json is not what dtrain writes: " + message, str(caught.value)), str(caught.value)


def test_a_trainer_json_whose_format_disagrees_with_its_marker_is_refused(stopped, tmp_path):
    """A format-3 marker with a trainer.json that states none (resealed after editing) would be read as
    format 2, whose checkpoints hold no registered parts: refused, not resumed without them."""
    run_dir = tmp_path / "run"
    shutil.copytree(stopped / "run", run_dir)
    folder = run_dir / "checkpoints" / "step-5"
    _rewrite(folder, lambda t: t.pop("format"), lambda m: None)
    with pytest.raises(CheckpointError) as caught:
        dtrain.Trainer(_config(run_dir), model=_model(), train_data=_data()).fit()
    assert str(caught.value) == (
        f"{folder / 'trainer.json'} states format none and its marker format 3: one of them was edited; "
        f"delete {folder} to resume from an earlier checkpoint"
    )
