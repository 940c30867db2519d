"""Context parallel (`parallel.cp_size`): torch's ring attention has no CPU rule, so only its pure
logic and its refusals are tested here; `benchmarks/gpu_check.sh` compares it with one process on 2+ GPUs."""

import json

import pytest
import torch

from dtrain.config import load_config
from dtrain.errors import ConfigError
from dtrain.models.gpt import GPT
from dtrain.parallel import check_sharding
from dtrain.parallel.context import ContextParallel, check_length, sequence_tensors
from helpers import SMALL_JOB, WORKERS, dtrain, ok


def test_context_parallel_off_cuda_is_refused_by_the_launcher_in_one_line(tmp_path):
    result = dtrain("run", *SMALL_JOB, "parallel.cp_size=2", f"run.dir={tmp_path / 'run'}", "--nproc", "2")
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == 2, result.stdout + result.stderr
    assert lines == [
        "dtrain: error: parallel.cp_size = 2: context parallel splits attention over CUDA GPUs (torch's "
        "context_parallel has no rule for it on the cpu); set parallel.cp_size=1"
    ]
    assert not (tmp_path / "run").exists()  # no worker started


def test_on_cuda_context_parallel_is_accepted_but_not_with_packed_documents():
    def config(*overrides):
        return load_config("examples/gpt_stdlib.toml", ["parallel.cp_size=2", *overrides])

    assert check_sharding(config(), 2, 2, "cuda") is None
    assert check_sharding(config("parallel.strategy=fsdp"), 4, 4, "cuda") is None
    assert check_sharding(config("data.packing=true"), 2, 2, "cuda") == (
        "parallel.cp_size = 2 runs causal ring attention, and data.packing = true needs a mask per "
        "document it cannot take; set data.packing=false or parallel.cp_size=1"
    )


def test_the_sequence_tensors_of_a_batch_are_split_and_per_sample_ones_are_not():
    inputs, targets = torch.zeros(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long)
    found = sequence_tensors((inputs, targets))
    assert len(found) == 2 and found[0] is inputs and found[1] is targets
    mask, label, other = torch.ones(2, 8), torch.zeros(2), torch.zeros(2, 3)
    batch = {"input_ids": inputs, "attention_mask": mask, "label": label, "extra": [other, {"labels": targets}]}
    assert [id(t) for t in sequence_tensors(batch)] == [id(inputs), id(mask), id(targets)]
    assert sequence_tensors((torch.zeros(4), torch.zeros(4))) == []  # per-sample values: nothing to split


def test_sequences_must_divide_into_two_chunks_per_process():
    assert check_length(64, 2) is None and check_length(64, 4) is None
    assert check_length(30, 4) == (
        "parallel.cp_size = 4 splits each sequence into 8 equal chunks and a sequence of 30 tokens does "
        "not divide into them; set data.block_size to a multiple of 8"
    )


def test_the_gpt_reads_its_positions_from_context_parallel_and_other_models_are_refused():
    torch.manual_seed(0)
    model = GPT(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8).eval()
    tokens = torch.randint(0, 16, (1, 4))
    plain = model(tokens)
    model.sequence_positions = torch.arange(4)  # what the context sets: the same positions, the same logits
    assert torch.equal(model(tokens), plain)
    model.sequence_positions = torch.arange(4, 8)  # the second half of an 8-token sequence: other positions
    assert not torch.allclose(model(tokens), plain)
    with pytest.raises(ConfigError) as caught:
        ContextParallel(torch.nn.Linear(2, 2), mesh=None)  # type: ignore[arg-type]
    assert str(caught.value) == (
        "parallel.cp_size > 1 splits the sequences of the built-in GPT (model.name=gpt), whose positions it "
        "can split too; Linear has no `sequence_positions`: set parallel.cp_size=1"
    )


def test_fsdp_shards_over_the_context_parallel_processes_too_and_cp_peers_must_hold_one_batch(warm_torchrun, tmp_path):
    """2 real processes: cp peers hold different tokens' gradients, so FSDP's mesh folds cp in; and the
    first step's check that they hold the same batches tells same from different (or reordered) ones."""
    out = tmp_path / "mesh.json"
    ok(warm_torchrun(WORKERS / "cp_mesh.py", out))
    found = json.loads(out.read_text())
    assert found["fsdp"] == {"names": ["dp_shard_cp"], "size": 2, "cp": 2}
    assert (found["same"], found["other"], found["swapped"]) == (True, False, False)
