"""Run under torchrun: tensor parallel of models dtrain has no plan for, against one process.

    torchrun --standalone --nproc-per-node 1 tensor_parallel.py OUT_DIR    (the reference: tp 1)
    torchrun --standalone --nproc-per-node 2 tensor_parallel.py OUT_DIR    (tp 2)

Each launch trains, into OUT_DIR/<name>-tp<N>: a tiny Hugging Face Llama by its own plan
(`base_model_tp_plan`), and an MLP by a plan given to the Trainer (`tp_plan=`). The tests compare the
run folders. Rank 0 writes OUT_DIR/refusals-tp<N>.json: what a model with no plan is told.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import tiny
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import Dataset, TensorDataset

import dtrain
from dtrain.errors import DtrainError

JOB = {
    "run": {"seed": 3},
    "data": {"batch_size": 4, "eval_batch_size": 6},
    "optimizer": {"name": "adamw", "lr": 0.01},
    "training": {"max_steps": 4, "log_every": 1, "grad_accum_steps": 2, "max_grad_norm": 0.05},
}
VOCAB, BLOCK = 64, 16


class Tokens(Dataset):
    """Dict samples, as a Hugging Face causal LM takes them (its loss from `labels`)."""

    def __init__(self, n: int, seed: int):
        self.ids = torch.randint(0, VOCAB, (n, BLOCK), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=BLOCK,
    )
    return tiny.seeded(lambda: LlamaForCausalLM(config), 3)


def mlp() -> nn.Module:
    return tiny.seeded(lambda: nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 3)), 3)


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    tp = dist.get_world_size()
    config = lambda name: tiny.job_config(out / f"{name}-tp{tp}", JOB, {"distributed": {"tp_size": tp}})  # noqa: E731
    dtrain.Trainer(config("llama"), model=llama(), train_data=Tokens(64, 0), eval_data=Tokens(10, 1)).fit()
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    points = lambda n, seed: tiny.points(n, 12, seed, lambda x: x[:, :3].argmax(1))  # noqa: E731
    data: TensorDataset = points(64, 0)
    dtrain.Trainer(config("mlp"), model=mlp(), train_data=data, eval_data=points(10, 1), tp_plan=plan).fit()
    refusals = {}
    if tp > 1:
        try:
            dtrain.Trainer(config("no_plan"), model=mlp(), train_data=data).setup()
        except DtrainError as exc:
            refusals["no_plan"] = str(exc)
    if dist.get_rank() == 0:
        (out / f"refusals-tp{tp}.json").write_text(json.dumps(refusals))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
