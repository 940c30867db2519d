"""A checkpoint is trusted only for what it is: read without unrestricted pickle, judged on its contents
when resealed after damage, refused when it holds part of a parameter's state; what it may still
continue under (another batch size, a stop step already reached, an earlier layout) resumes."""

import json
import os
import pickle
import re
import shutil

import pytest
import torch
from tiny import OUT
from tiny import small_config as config
from tiny import small_data as data
from tiny import small_model as model

import dtrain
from dtrain.checkpoint.store import CheckpointError
from dtrain.checkpoint.tensors import SafeReader

# --- checkpoints are read without unrestricted pickle ----------------------------------------------


class Payload:
    """What a malicious checkpoint would carry: unpickling it runs a command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_the_checkpoint_reader_refuses_a_pickle_that_would_run_code(tmp_path):
    dtrain.Trainer(config(tmp_path / "run", training={"stop_at_step": 3}), model=model(), train_data=data()).fit()
    state = tmp_path / "run" / "checkpoints" / "step-3" / "state"
    assert SafeReader(state).read_metadata().state_dict_metadata  # the real metadata reads fine
    marker = tmp_path / "pwned"
    (state / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(
        CheckpointError,
        match=r"is not DCP metadata dtrain can trust \(unexpected object "
        r"(posix|os)\.system\)",
    ):
        SafeReader(state).read_metadata()
    assert not marker.exists()  # nothing ran
    # Harmless objects that are not DCP's metadata are refused as plainly, not met later by a traceback.
    from torch.distributed.checkpoint.metadata import MetadataIndex

    for thing, named in (
        ({"state_dict_metadata": {}}, "a dict, not DCP's Metadata"),
        (MetadataIndex("model.weight"), "a MetadataIndex, not DCP's Metadata"),
    ):
        (state / ".metadata").write_bytes(pickle.dumps(thing))
        with pytest.raises(CheckpointError, match=re.escape(f"is not DCP metadata dtrain can trust ({named})")):
            SafeReader(state).read_metadata()


class WithASpareLayer(torch.nn.Module):
    """A model one of whose layers never takes part (a head kept for later): AdamW never gives it state."""

    def __init__(self):
        super().__init__()
        self.net, self.spare = model(), torch.nn.Linear(OUT, OUT)

    def forward(self, x):
        return self.net(x)


def test_a_parameter_without_optimizer_state_resumes_bitwise(tmp_path):
    """The checkpoint holds AdamW state for the layers that trained and none for the spare one; the resume
    reads what is there (not what DCP's own initialisation of the optimizer would give every parameter) and
    ends with the weights of the run never stopped."""
    adamw = {"optimizer": {"name": "adamw", "lr": 0.01}}
    whole, run_dir = tmp_path / "whole", tmp_path / "run"
    dtrain.Trainer(config(whole, **adamw), model=WithASpareLayer(), train_data=data()).fit()
    dtrain.Trainer(
        config(run_dir, **adamw, training={"epochs": 2, "log_every": 5, "stop_at_step": 7}),
        model=WithASpareLayer(),
        train_data=data(),
    ).fit()
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(run_dir / "checkpoints" / "step-7" / "state").read_metadata().state_dict_metadata
    assert "optimizer.state.net.0.weight.exp_avg" in saved and "model.spare.weight" in saved
    assert not any(key.startswith("optimizer.state.spare.") for key in saved)
    dtrain.Trainer(config(run_dir, **adamw), model=WithASpareLayer(), train_data=data()).fit()
    from safetensors.torch import load_file

    resumed, expected = load_file(run_dir / "model.safetensors"), load_file(whole / "model.safetensors")
    assert resumed.keys() == expected.keys() and all(torch.equal(resumed[k], expected[k]) for k in expected)


def reseal(folder):
    """Seal checkpoint `folder` again over what is in it now, as a careless tool might after editing it:
    what dtrain then reads is the edited content itself, past the integrity check."""
    import json

    from dtrain.checkpoint.manifest import MARKER, manifest

    marker = json.loads((folder / MARKER).read_text())
    files = {name: entry for name, entry in manifest(folder).items() if name != MARKER}
    (folder / MARKER).write_text(json.dumps({**marker, "files": files}))


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A run of 20 steps stopped at step 7 (training.stop_at_step): its checkpoint, to copy and spoil."""
    run_dir = tmp_path_factory.mktemp("stopped") / "run"
    dtrain.Trainer(
        config(run_dir, training={"epochs": 2, "log_every": 5, "stop_at_step": 7}), model=model(), train_data=data()
    ).fit()
    return run_dir


def _edit_trainer_json(folder, change):
    import json

    trainer = json.loads((folder / "trainer.json").read_text())
    change(trainer)
    (folder / "trainer.json").write_text(json.dumps(trainer))


@pytest.mark.parametrize(
    "spoil, message",
    [
        (
            lambda f: _edit_trainer_json(f, lambda t: t["optimizer"]["param_groups"][0].update(lr="fast")),
            r"trainer.json is not what dtrain writes: optimizer setting lr is 'fast', not a finite number >= 0",
        ),
        (
            lambda f: _edit_trainer_json(f, lambda t: t["optimizer"]["param_groups"][0].update(lr=-1.0)),
            r"trainer.json is not what dtrain writes: optimizer setting lr is -1.0, not a finite number >= 0",
        ),
        (
            lambda f: _edit_trainer_json(f, lambda t: t["scheduler"].update(last_epoch="x")),
            r"trainer.json is not what dtrain writes: scheduler last_epoch is 'x', not a whole number",
        ),
        (
            lambda f: _edit_trainer_json(f, lambda t: t.update(step=19)),
            r"trainer.json says step 19 and its folder is step-7: it was edited or copied from another checkpoint",
        ),
        (
            lambda f: [p.write_bytes(p.read_bytes()[:100]) for p in (f / "state").glob("*.distcp")],
            r"checkpoint step-7's tensors in \S+/state cannot be read into this run \(.+\): damaged, or written for "
            r"another optimizer; delete \S+/step-7 to resume from an earlier checkpoint",
        ),
        (
            lambda f: (f / "state" / ".metadata").write_bytes(
                (f / "state" / ".metadata").read_bytes().replace(b"__0_0.distcp", b"../_0.distcp")
            ),  # the same length: the pickle stays whole
            r"is not DCP metadata dtrain can trust \(it points at '../_0.distcp', outside \S+/state\)",
        ),
    ],
)
def test_a_resealed_checkpoint_with_spoiled_contents_is_refused_in_one_line(stopped, tmp_path, spoil, message):
    """Past the seal's checksums (resealed), what is read is judged itself: one line naming the file and
    the way out, never a traceback, a file outside the checkpoint, or a resume that trains on in silence."""
    run_dir = tmp_path / "run"
    shutil.copytree(stopped, run_dir)
    folder = run_dir / "checkpoints" / "step-7"
    spoil(folder)
    reseal(folder)
    with pytest.raises(CheckpointError) as caught:
        dtrain.Trainer(config(run_dir, training={"epochs": 2, "log_every": 5}), model=model(), train_data=data()).fit()
    assert "\n" not in str(caught.value) and re.search(message, str(caught.value)), str(caught.value)
    assert (folder / "trainer.json").is_file()  # the checkpoint is left for the user to judge


def test_a_resume_with_another_batch_size_keeps_the_global_batch(stopped, tmp_path, capfd):
    """data.batch_size halved on resume: the accumulation doubles to keep the checkpoint's global batch
    (said in one line), and the run ends where the one never stopped does (summed in another order)."""
    whole = tmp_path / "whole"
    dtrain.Trainer(config(whole, training={"epochs": 2, "log_every": 5}), model=model(), train_data=data()).fit()
    run_dir = tmp_path / "run"
    shutil.copytree(stopped, run_dir)
    with pytest.raises(
        dtrain.DtrainError,
        match=r"checkpoint step-7 trained on global batches of 16 samples \(1 process × "
        r"16\); 1 process with data.batch_size=5 cannot make that up in whole accumulation steps: set "
        r"data.batch_size to a divisor of 16, such as 2, 4, 8, 16$",
    ):
        dtrain.Trainer(config(run_dir, data={"batch_size": 5}), model=model(), train_data=data()).fit()
    capfd.readouterr()
    trainer = dtrain.Trainer(
        config(run_dir, data={"batch_size": 8}, training={"epochs": 2, "log_every": 5}),
        model=model(),
        train_data=data(),
    )
    trainer.fit()
    assert (
        "step-7 took global batches of 16 samples: with data.batch_size=8 on 1 process, "
        "training.grad_accum_steps 2 (not the config's 1) keeps them"
    ) in capfd.readouterr().err
    assert trainer.step == 20 and trainer.config.training.grad_accum_steps == 2
    from safetensors.torch import load_file

    resumed, expected = load_file(run_dir / "model.safetensors"), load_file(whole / "model.safetensors")
    assert all(torch.allclose(resumed[k], expected[k], atol=1e-6, rtol=0) for k in expected)


def test_a_checkpoint_holding_part_of_a_parameters_optimizer_state_is_refused(tmp_path):
    """AdamW's moments of one parameter gone from a resealed checkpoint: refused in one line, not resumed
    with zeros in their place (a parameter with no state at all is one that never had a gradient)."""
    adamw = {"optimizer": {"name": "adamw", "lr": 0.01}}
    run_dir = tmp_path / "run"
    dtrain.Trainer(
        config(run_dir, **adamw, training={"epochs": 2, "log_every": 5, "stop_at_step": 7}),
        model=model(),
        train_data=data(),
    ).fit()
    folder = run_dir / "checkpoints" / "step-7"
    path = folder / "state" / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # dtrain's own file, in a test: trusted
    del metadata.state_dict_metadata["optimizer.state.0.weight.exp_avg_sq"]
    path.write_bytes(pickle.dumps(metadata))
    reseal(folder)
    with pytest.raises(
        CheckpointError,
        match=r"^checkpoint step-7 holds part of the optimizer state of '0.weight' "
        r"\(no 'exp_avg_sq'\): damaged, or written for another optimizer",
    ):
        dtrain.Trainer(config(run_dir, **adamw), model=model(), train_data=data()).fit()


def test_stop_at_step_already_reached_trains_nothing_and_one_beyond_the_end_checkpoints_it(stopped, tmp_path, capfd):
    """Rerunning the stopping command (a requeue) does not train on past training.stop_at_step; a
    stop_at_step beyond the run's end checkpoints the end, so the command without it finds the run
    complete rather than refusing a run.dir without checkpoints."""
    run_dir = tmp_path / "run"
    shutil.copytree(stopped, run_dir)
    capfd.readouterr()
    for stop_at in (7, 5):
        trainer = dtrain.Trainer(
            config(run_dir, training={"epochs": 2, "log_every": 5, "stop_at_step": stop_at}),
            model=model(),
            train_data=data(),
        )
        trainer.fit()
        assert trainer.step == 7
        assert (
            f"training.stop_at_step={stop_at} and the run is at step 7 already: nothing trained; rerun without "
            f"it (or with a later step) to continue"
        ) in capfd.readouterr().err
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-7"]
    assert not (run_dir / "model.safetensors").exists()

    beyond = tmp_path / "beyond"
    dtrain.Trainer(
        config(beyond, training={"epochs": 2, "log_every": 5, "stop_at_step": 100}), model=model(), train_data=data()
    ).fit()
    assert sorted(p.name for p in (beyond / "checkpoints").iterdir()) == ["step-20"]
    capfd.readouterr()
    again = dtrain.Trainer(config(beyond), model=model(), train_data=data())
    again.fit()
    assert re.search(r"\(step 20 of 20, epoch 2 of 2\): the run is already complete", capfd.readouterr().err)


def test_a_checkpoint_in_the_earlier_flat_layout_still_resumes_bitwise(tmp_path):
    """dtrain 0.2 named its DCP tensors itself ("model/<fqn>", "optimizer/<fqn>/<name>"); checkpoints now
    keep DCP's own nested paths. A 0.2 checkpoint (rewritten here from a new one, key by key, and sealed
    again) still resumes, to the very weights of the run never stopped."""
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint import save as dcp_save

    from dtrain.checkpoint.manifest import MARKER
    from dtrain.checkpoint.store import CheckpointStore

    adamw = {"optimizer": {"name": "adamw", "lr": 0.01}}
    whole = tmp_path / "whole"
    dtrain.Trainer(config(whole, **adamw), model=model(), train_data=data()).fit()
    run_dir = tmp_path / "run"
    dtrain.Trainer(
        config(run_dir, **adamw, training={"epochs": 2, "log_every": 5, "stop_at_step": 7}),
        model=model(),
        train_data=data(),
    ).fit()
    folder = run_dir / "checkpoints" / "step-7"
    items = FileSystemReader(folder / "state").read_metadata().state_dict_metadata
    state = {key: torch.empty(item.size, dtype=item.properties.dtype) for key, item in items.items()}
    dcp_load(state, storage_reader=FileSystemReader(folder / "state"), no_dist=True)
    assert {key.split(".")[0] for key in state} == {"model", "optimizer"}
    assert any(key.endswith(".exp_avg_sq") for key in state)
    old = {}
    for key, tensor in state.items():
        if key.startswith("model."):
            old["model/" + key[len("model.") :]] = tensor
        else:
            fqn, name = key[len("optimizer.state.") :].rsplit(".", 1)
            old[f"optimizer/{fqn}/{name}"] = tensor
    shutil.rmtree(folder / "state")
    dcp_save(old, storage_writer=FileSystemWriter(folder / "state"), no_dist=True)
    # Nor did it number its format (1), nor name its parts: only the checkpoint's own number says its layout.
    _edit_trainer_json(folder, lambda t: [t.pop("format"), t.pop("parts")])
    marker = json.loads((folder / MARKER).read_text())
    del marker["format"]
    (folder / MARKER).write_text(json.dumps(marker))
    reseal(folder)
    assert CheckpointStore(run_dir).newest().step == 7  # sealed as dtrain 0.2 would have left it

    dtrain.Trainer(config(run_dir, **adamw), model=model(), train_data=data()).fit()
    from safetensors.torch import load_file

    resumed, expected = load_file(run_dir / "model.safetensors"), load_file(whole / "model.safetensors")
    assert resumed.keys() == expected.keys() and all(torch.equal(resumed[k], expected[k]) for k in expected)
