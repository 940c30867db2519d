"""`dtrain export --format hf` and `checkpoint.export = "hf"`: a run's weights as a Hugging Face folder that
`AutoModelForCausalLM.from_pretrained` loads with the same outputs as dtrain's own model — the built-in GPT
as GPT-2, a Hugging Face GPT-2 and Llama under their own names — from runs of 2 processes under DDP and
FSDP, from their final weights and from a checkpoint read by one process."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

import dtrain
from dtrain import models
from dtrain.checkpoint.tensors import read_model_weights
from dtrain.config import read_config
from dtrain.data.prepare import Bytes, load_tokenizer
from dtrain.errors import DtrainError
from dtrain.export.hf import export_hf
from dtrain.rundir import check_contents
from dtrain.rundir.lock import RunDirLock
from helpers import SMALL_JOB, WORKERS, ok
from helpers import dtrain as run_dtrain

transformers = pytest.importorskip("transformers")  # the test extra installs it
sys.path.insert(0, str(WORKERS))
from hf_models import BLOCK, VOCAB, tiny  # noqa: E402 — the worker's own model, rebuilt here

GPT = [
    "examples/gpt_stdlib.toml",
    "data.block_size=32",
    "data.batch_size=4",
    "training.epochs=1",
    "training.max_steps=8",
    "training.log_every=4",
    "model.options={n_layer = 2, n_head = 2, n_embd = 32}",
    "scheduler.warmup_steps=2",
    "optimizer.lr=0.01",
    "checkpoint.every_steps=4",
]


@pytest.fixture(scope="module")
def prepared(json_bpe_tokens):
    return json_bpe_tokens


@pytest.fixture(scope="module")
def gpt_ddp(warm, prepared, tmp_path_factory):
    """The built-in GPT on 2 processes under DDP, exported at its end (checkpoint.export = hf)."""
    run_dir = tmp_path_factory.mktemp("gpt_ddp")
    ok(warm("run", *GPT, f"data.path={prepared}", f"run.dir={run_dir}", "checkpoint.export=hf", "--nproc", "2"))
    return run_dir


@pytest.fixture(scope="module")
def gpt_fsdp(warm, prepared, tmp_path_factory):
    """The built-in GPT on 2 processes under FSDP (its checkpoints sharded), exported afterwards."""
    run_dir = tmp_path_factory.mktemp("gpt_fsdp")
    ok(warm("run", *GPT, f"data.path={prepared}", f"run.dir={run_dir}", "parallel.strategy=fsdp", "--nproc", "2"))
    ok(run_dtrain("export", str(run_dir), "--format", "hf"))
    return run_dir


@pytest.fixture(scope="module")
def hf_runs(warm, tmp_path_factory):
    """A Hugging Face GPT-2 under DDP and a Llama-style model under FSDP, each on 2 processes."""
    runs = {}
    for kind, strategy in (("gpt2", "ddp"), ("llama", "fsdp")):
        runs[kind] = tmp_path_factory.mktemp(kind)
        script = str(WORKERS / "hf_models.py")
        ok(warm("launch", "--nproc", "2", script, kind, str(runs[kind]), f"parallel.strategy={strategy}"))
    return runs


def export(run_dir: Path, out: Path, step: int | None = None, max_shard_size: str = "") -> Path:
    """What `dtrain export` runs, in this process (transformers imported once, not per command)."""
    return export_hf(run_dir, out, step, max_shard_size)


def built_gpt(run_dir: Path, step: int | None = None) -> torch.nn.Module:
    """dtrain's own model of the run: built from its config.toml, its final weights or checkpoint step-N."""
    config, _ = read_config(run_dir / "config.toml")
    meta = json.loads((run_dir / "tokenizer" / "meta.json").read_text())
    model = models.build(config.model, (config.data.block_size,), meta["vocab_size"])
    if step is None:
        model.load_state_dict(dtrain.load_weights(run_dir / "model.safetensors"))
    else:
        read_model_weights(run_dir / "checkpoints" / f"step-{step}", model.state_dict())
    return model.eval()


def assert_same_logits(ours: torch.nn.Module, folder: Path, vocab: int, length: int) -> None:
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.randint(0, vocab, (3, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(ids), theirs(ids).logits
    a = a.logits if hasattr(a, "logits") else a
    assert a.shape == b.shape and (a - b).abs().max().item() <= 1e-5, (a - b).abs().max()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_built_in_gpt_loads_as_gpt2_with_its_logits_and_its_greedy_text(strategy, request, tmp_path):
    run_dir = request.getfixturevalue(f"gpt_{strategy}")
    folder = run_dir / "hf"  # DDP: written by the run's end; FSDP: by `dtrain export` with the default --out
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert type(model).__name__ == "GPT2LMHeadModel" and model.config.activation_function == "gelu"
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # tied, as trained
    assert_same_logits(built_gpt(run_dir), folder, 300, 32)
    # The checkpoint at step 4, its shards read by this one process: the weights of step 4, not the end's.
    at_4 = export(run_dir, tmp_path / "step-4", step=4)
    assert_same_logits(built_gpt(run_dir, step=4), at_4, 300, 32)
    with torch.no_grad():
        ids = torch.arange(32)[None] % 300
        assert not torch.allclose(built_gpt(run_dir, step=4)(ids), built_gpt(run_dir)(ids))
    # The tokenizer is the run's: the same ids, and greedy generation continues a prompt as `dtrain generate`.
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    kept = load_tokenizer(run_dir / "tokenizer", json.loads((run_dir / "tokenizer" / "meta.json").read_text()))
    text = "def load(fp, *, cls=None):\n    return"
    assert tokenizer.encode(text) == kept.encode(text).ids
    said = ok(run_dtrain("generate", str(run_dir), "--prompt", "def ", "--tokens", "20", "--temperature", "0")).stdout
    prompt = tokenizer("def ", return_tensors="pt").input_ids
    out = model.eval().generate(prompt, max_new_tokens=20, do_sample=False)
    new = out[0, prompt.shape[1] :]
    assert len(new) == 20 or new[-1] == tokenizer.eos_token_id  # HF stops at end-of-text
    continued = "def " + tokenizer.decode(new, skip_special_tokens=True)
    assert said.rstrip("\n").startswith(continued) and len(continued) > len("def ") + 5
    if len(new) == 20:
        assert said.rstrip("\n") == continued


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_hugging_face_model_exports_under_its_own_config_and_names(kind, hf_runs, tmp_path):
    run_dir = hf_runs[kind]
    described = json.loads((run_dir / "model.json").read_text())
    assert described["kind"] == "transformers" and described["architecture"] == type(tiny(kind)).__name__
    folder = export(run_dir, tmp_path / "final")
    assert not (folder / "tokenizer.json").exists()  # random tokens: no tokenizer to give
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [type(tiny(kind)).__name__] and config["vocab_size"] == VOCAB
    ours = tiny(kind).eval()
    ours.load_state_dict(dtrain.load_weights(run_dir / "model.safetensors"))
    assert_same_logits(ours, folder, VOCAB, BLOCK)
    at_2 = export(run_dir, tmp_path / "step-2", step=2)
    read_model_weights(run_dir / "checkpoints" / "step-2", ours.state_dict())
    assert_same_logits(ours, at_2, VOCAB, BLOCK)
    generated = transformers.GenerationConfig.from_pretrained(folder)
    assert generated.eos_token_id == ours.config.eos_token_id


def test_weights_past_the_shard_size_are_sharded_with_an_index_from_pretrained_reads(gpt_ddp, tmp_path):
    folder = export(gpt_ddp, tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(folder.glob("model-*.safetensors"))
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == [f.name for f in files]
    assert not (folder / "model.safetensors").exists()
    for file in files:  # none past the limit, but for a single tensor larger than it
        assert (
            file.stat().st_size <= 40_000 + 4096
            or len([v for v in index["weight_map"].values() if v == file.name]) == 1
        )
    assert_same_logits(built_gpt(gpt_ddp), folder, 300, 32)
    # Exported again over it: replaced whole (no shard of the earlier export left beside a single file).
    export(gpt_ddp, folder)
    assert sorted(p.name for p in folder.glob("model*")) == ["model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left


def test_weights_are_read_a_bounded_amount_at_a_time_whatever_the_shard_size(gpt_ddp, tmp_path, monkeypatch):
    """One file of the whole model (the default 50GB shard size) is still read and written a group of
    tensors at a time: no read larger than READ_BYTES, but for a single tensor larger than it."""
    from dtrain.export import hf as hf_export

    reads: list[int] = []
    step_8 = hf_export._complete_checkpoint(gpt_ddp, 8)
    checkpoint = hf_export._checkpoint_weights(gpt_ddp, step_8)  # the FSDP-able source: DCP read by names
    read = checkpoint.read

    def counted(names: list[str]) -> dict[str, torch.Tensor]:
        tensors = read(names)
        reads.append(sum(t.numel() * t.element_size() for t in tensors.values()))
        return tensors

    monkeypatch.setattr(checkpoint, "read", counted)
    monkeypatch.setattr(hf_export, "_checkpoint_weights", lambda run_dir, step_n: checkpoint)
    monkeypatch.setattr(hf_export, "READ_BYTES", 20_000)
    folder = export(gpt_ddp, tmp_path / "bounded", step=8)
    largest = 300 * 32 * 4  # the token embedding
    assert len(reads) > 3 and max(reads) <= max(20_000, largest)
    assert [p.name for p in folder.glob("model*")] == ["model.safetensors"]
    assert_same_logits(built_gpt(gpt_ddp, step=8), folder, 300, 32)


def test_checkpoint_export_hf_writes_run_dir_hf_at_the_end_and_run_dir_stays_dtrains(gpt_ddp, gpt_fsdp):
    assert (gpt_ddp / "hf" / "config.json").is_file() and (gpt_ddp / "hf" / "tokenizer.json").is_file()
    assert json.loads((gpt_ddp / "model.json").read_text())["kind"] == "gpt"
    assert json.loads((gpt_ddp / "hf" / "generation_config.json").read_text())["eos_token_id"] == 0  # end-of-text
    for run_dir in (gpt_ddp, gpt_fsdp):
        check_contents(run_dir, allow_other_files=False)  # hf/ and model.json are recognised as dtrain's


def test_the_byte_tokenizer_exports_as_the_same_bytes():
    ours, theirs = Bytes(), Bytes().as_tokenizers()
    for text in ("héllo wörld\n\tdef f(x):  return ✓", "", "  two  spaces "):
        assert theirs.encode(text).ids == ours.encode(text) and theirs.decode(theirs.encode(text).ids) == text
    assert theirs.token_to_id("<|endoftext|>") == ours.eot


def test_what_cannot_be_exported_is_refused_in_one_line(warm, cli, gpt_ddp, tmp_path):
    def refused(*args: str) -> str:
        result = cli("export", *args)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
        return result.stderr.strip()

    mlp = tmp_path / "mlp"
    ok(warm("run", *SMALL_JOB, f"run.dir={mlp}", "training.epochs=1"))
    assert refused(str(mlp), "--format", "hf") == (
        f"dtrain: error: {mlp}: the run trained a Sequential: export needs the built-in gpt (model.name = gpt) "
        f"or a Hugging Face transformers model"
    )
    # Asked for at the end of a run that cannot give it: refused before training, nothing written.
    at_end = cli("run", *SMALL_JOB, f"run.dir={tmp_path / 'never'}", "checkpoint.export=hf")
    assert at_end.returncode == 2 and "checkpoint.export = hf: the run trained a Sequential" in at_end.stderr
    assert not (tmp_path / "never").exists()
    for args, message in (  # in this process: the same function, without a command's start-up each
        ((tmp_path / "nope", None), f"{tmp_path / 'nope'} is not a folder: RUN_DIR must be a dtrain run's run.dir"),
        (
            (gpt_ddp, None, 5),
            f"{gpt_ddp / 'checkpoints'} holds no complete checkpoint step-5 (complete ones: step-4, step-8)",
        ),
        (
            (gpt_ddp, None, None, "5 parsecs"),
            "--max-shard-size '5 parsecs' is not a size: give bytes or a size such as 500MB or 5GB",
        ),
    ):
        with pytest.raises(DtrainError) as error:
            export_hf(*args)
        assert str(error.value) == message
    assert "--format 'onnx' is not one dtrain writes" in refused(str(gpt_ddp), "--format", "onnx")
    assert "--max-shard-size '5 parsecs' is not a size" in refused(
        str(gpt_ddp), "--format", "hf", "--max-shard-size", "5 parsecs"
    )
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert refused(str(gpt_ddp), "--format", "hf", "--out", str(mine)) == (
        f"dtrain: error: --out {mine} holds notes.txt (a folder of yours?); export writes a folder there only over "
        f"one it exported: choose another --out, or move it"
    )
    assert (mine / "notes.txt").read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["mine", "mlp"]
    lock = RunDirLock(gpt_ddp)  # a run still training there: its own end may write run.dir/hf
    lock.acquire()
    try:
        assert "is still training" in refused(str(gpt_ddp), "--format", "hf")
    finally:
        lock.release()


def test_a_disk_filling_during_export_is_one_line_and_leaves_out_as_it_was(gpt_ddp, tmp_path):
    """A write that fails half-way (here past a file-size limit, failing as a full disk fails it) is one
    line (a DtrainError: exit 2), no staging folder left, and the earlier export at --out kept as it was."""
    import resource

    out = export(gpt_ddp, tmp_path / "hf", step=4)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, hard))  # the weights (~150 KB) cannot be written
    try:
        with pytest.raises(DtrainError) as error:
            export(gpt_ddp, out)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert str(error.value).startswith(f"could not write the export to {out} (File too large); {out} is as it was")
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_checkpoint_pruned_while_it_is_exported_is_one_line(gpt_ddp, tmp_path, monkeypatch):
    """Exporting a checkpoint of a run still training races its `checkpoint.keep` pruning: the checkpoint
    deleted half-way through the read is said as such — not a traceback, not "damaged, delete it"."""
    from dtrain.checkpoint import tensors

    run_dir = tmp_path / "run"
    shutil.copytree(gpt_ddp, run_dir)
    step_4 = run_dir / "checkpoints" / "step-4"
    read = tensors.read_model_weights

    def pruned_meanwhile(folder, state):  # what the run's pruning does between two reads
        shutil.rmtree(step_4, ignore_errors=True)
        return read(folder, state)

    monkeypatch.setattr(tensors, "read_model_weights", pruned_meanwhile)
    with pytest.raises(DtrainError) as error:
        export(run_dir, tmp_path / "out", step=4)
    assert str(error.value) == (
        f"{step_4} was deleted while it was exported (a run still training keeps only its checkpoint.keep newest); "
        f"{tmp_path / 'out'} is as it was: export a newer step, or this one from a copy"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_sigterm_while_export_writes_leaves_neither_out_nor_staging_folder(gpt_ddp, tmp_path):
    """SIGTERM with the weights written into the staging folder (as the tokenizer's module is imported):
    exit 75 and the one line export's own, not a run's ("before training began") — and nothing left
    beside --out, where the process ending at once used to leave its staging folder."""
    import os

    from helpers import env

    out = tmp_path / "hf"
    pythonpath = os.pathsep.join([str(WORKERS / "process_faults"), env()["PYTHONPATH"]])
    result = run_dtrain(
        "export",
        str(gpt_ddp),
        "--format",
        "hf",
        "--step",
        "4",
        "--out",
        str(out),
        extra_env={"SIGTERM_AT_IMPORT": "dtrain.data.prepare", "PYTHONPATH": pythonpath},
    )
    assert [p.name for p in tmp_path.iterdir()] == [], result.stderr
    assert result.returncode == 75, result.stderr
    assert result.stderr.strip() == (
        f"dtrain: error: stopped by SIGTERM; nothing was written to {out} — rerun the same command to export it"
    )


def test_an_empty_run_dir_or_out_is_refused_not_taken_for_the_current_folder(cli, tmp_path):
    """`dtrain export "$RUN" --format hf` with RUN unset: one line, not an export of the current folder."""
    for args, what in (([""], "RUN_DIR"), ([str(tmp_path), "--out", " "], "--out")):
        result = cli("export", *args, "--format", "hf", cwd=tmp_path)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
        assert result.stderr.startswith(f"dtrain: error: {what} is empty (an unset shell variable?)"), result.stderr
    assert not any(tmp_path.iterdir())
