"""Run under torchrun: tensor parallel of models dtrain has no plan for, against one process.

    torchrun --standalone --nproc-per-node 1 tensor_parallel.py OUT_DIR    (the reference: tp 1)
    torchrun --standalone --nproc-per-node 2 tensor_parallel.py OUT_DIR    (tp 2)

Each launch trains, into OUT_DIR/<name>-tp<N>: a tiny Hugging Face Llama by its own plan
(`base_model_tp_plan`), an MLP by a plan given to the Trainer (`tp_plan=`), and the built-in GPT with a
wide vocabulary twice: with dtrain's loss ("gpt": loss parallel under tp) and with the same cross-entropy
as a user's `loss_fn` ("gpt_loss_fn": its logits gathered whole). The tests compare the run folders.
Rank 0 writes OUT_DIR/refusals-tp<N>.json: what a model with no plan is told; every rank writes
OUT_DIR/logits-tp<N>-rank<R>.json: the most bytes of logits-sized tensors it saved for backward.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import tiny
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import Dataset, TensorDataset

import dtrain
from dtrain.errors import DtrainError
from dtrain.models.gpt import GPT

JOB = {
    "run": {"seed": 3},
    "data": {"batch_size": 4, "eval_batch_size": 6},
    "optimizer": {"name": "adamw", "lr": 0.01},
    "training": {"max_steps": 4, "log_every": 1, "grad_accum_steps": 2, "max_grad_norm": 0.05},
}
VOCAB, BLOCK = 64, 16
WIDE_VOCAB = 512  # the GPT's: its logits the largest activation, as in a real language model


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


def gpt() -> GPT:
    return tiny.seeded(lambda: GPT(vocab_size=WIDE_VOCAB, block_size=BLOCK, n_layer=1, n_head=4, n_embd=32), 3)


def windows(n: int, seed: int) -> TensorDataset:
    """(inputs, next tokens) windows: the GPT's loss is dtrain's cross-entropy over every position."""
    ids = torch.randint(0, WIDE_VOCAB, (n, BLOCK + 1), generator=torch.Generator().manual_seed(seed))
    return TensorDataset(ids[:, :-1], ids[:, 1:])


def top_logit(logits: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The mean of each position's highest score: a metric over every class's prediction."""
    return {"top_logit": logits.max(-1).values.mean()}


class LogitsSaved:
    """The most bytes this rank holds of one tensor the size of the logits (batch × positions × vocabulary)
    that autograd saved for backward (the log-probabilities the loss keeps): its local shard if a DTensor."""

    def __init__(self, batch: int):
        self.numel, self.most = batch * BLOCK * WIDE_VOCAB, 0

    def pack(self, saved: torch.Tensor) -> torch.Tensor:
        if saved.numel() == self.numel:  # the whole size; held here: the shard's bytes
            local = saved.to_local() if isinstance(saved, DTensor) else saved
            self.most = max(self.most, local.numel() * local.element_size())
        return saved


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    tp = dist.get_world_size()
    config = lambda name: tiny.job_config(out / f"{name}-tp{tp}", JOB, {"parallel": {"tp_size": tp}})  # noqa: E731
    dtrain.Trainer(config("llama"), model=llama(), train_data=Tokens(64, 0), eval_data=Tokens(10, 1)).fit()
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    points = lambda n, seed: tiny.points(n, 12, seed, lambda x: x[:, :3].argmax(1))  # noqa: E731
    data: TensorDataset = points(64, 0)
    dtrain.Trainer(config("mlp"), model=mlp(), train_data=data, eval_data=points(10, 1), tp_plan=plan).fit()
    held, generated = {}, {}
    for name, loss_fn in (
        ("gpt", None),
        ("gpt_loss_fn", lambda logits, target: F.cross_entropy(logits.flatten(0, 1), target.flatten())),
    ):
        saved = LogitsSaved(JOB["data"]["batch_size"])
        model = gpt()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda kept: kept):
            train, test = windows(64, 0), windows(10, 1)  # top_logit: over predictions, logits gathered for it
            dtrain.Trainer(
                config(name), model=model, train_data=train, eval_data=test, loss_fn=loss_fn, eval_metrics=top_logit
            ).fit()
        held[name] = saved.most
        # The trained model, still split (this script's group lives on), continues a 3-token prompt.
        generated[name] = model.generate(windows(1, 2)[0][0][None, :3], 6, temperature=0).tolist()
    rank = dist.get_rank()
    (out / f"logits-tp{tp}-rank{rank}.json").write_text(json.dumps(held))
    (out / f"generated-tp{tp}-rank{rank}.json").write_text(json.dumps(generated))
    refusals = {}
    if tp > 1:
        try:
            dtrain.Trainer(config("no_plan"), model=mlp(), train_data=data).setup()
        except DtrainError as exc:
            refusals["no_plan"] = str(exc)
        try:
            typo = {"0": ColwiseParallel(), "layers.*.up": ColwiseParallel()}
            dtrain.Trainer(config("no_match"), model=mlp(), train_data=data, tp_plan=typo).setup()
        except DtrainError as exc:
            refusals["no_match"] = str(exc)
        try:
            dtrain.Trainer(config("empty"), model=mlp(), train_data=data, tp_plan={}).setup()
        except DtrainError as exc:
            refusals["empty"] = str(exc)
    if dist.get_rank() == 0:
        (out / f"refusals-tp{tp}.json").write_text(json.dumps(refusals))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
