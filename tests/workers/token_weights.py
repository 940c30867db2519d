"""One SGD step at lr 1 on four padded sequences of different lengths, trained by dtrain as a user
would: a tiny Hugging Face GPT-2 (dict batches, its own shifted token-mean `.loss`) and dtrain's own GPT
(`(inputs, targets)` with -100 at the padding, the default cross-entropy).

    python token_weights.py OUT 2                       # one process: batch 2 x accumulation 2
    torchrun --nproc-per-node 2 token_weights.py OUT 1  # two processes: batch 2 on each

Rank 0 writes OUT/{hf,gpt}.pt (the weights after the step) and leaves each run's metrics.jsonl in
OUT/{hf,gpt}/; the same four samples are the eval set (batches of 3: of unequal tokens). The test
computes the one-batch update of all four samples itself and compares.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

import dtrain
from dtrain.models.gpt import GPT

LENGTHS = (15, 6, 12, 23)  # tokens per sequence; every sequence padded to the longest
VOCAB, PAD = 40, 0


def sequences() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in LENGTHS]


def padded(seq: torch.Tensor, to: int, value: int) -> torch.Tensor:
    return torch.cat([seq, torch.full((to - len(seq),), value, dtype=seq.dtype)])


def hf_samples() -> list[dict[str, torch.Tensor]]:
    """As a Hugging Face tokenizer pads them: labels are the inputs, -100 at the padding."""
    longest = max(LENGTHS)
    return [
        {
            "input_ids": padded(s, longest, PAD),
            "attention_mask": padded(torch.ones_like(s), longest, 0),
            "labels": padded(s, longest, -100),
        }
        for s in sequences()
    ]


def gpt_samples() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inputs and next-token targets, shifted here; -100 where a target is padding."""
    longest = max(LENGTHS) - 1
    return [(padded(s[:-1], longest, PAD), padded(s[1:], longest, -100)) for s in sequences()]


def hf_model() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=1, n_head=2, bos_token_id=1, eos_token_id=1
    )
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    return GPT2LMHeadModel(config)


def gpt_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, block_size=32, n_layer=1, n_head=2, n_embd=16)


class Listed(Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def main(out: Path, accum: int) -> None:
    if "RANK" in os.environ:  # under torchrun: one group for both runs
        dist.init_process_group("gloo")
    for name, model, samples in (("hf", hf_model(), hf_samples()), ("gpt", gpt_model(), gpt_samples())):
        config = dtrain.Config.from_dict(
            {
                "run": {"dir": str(out / name)},
                "data": {"batch_size": 2, "eval_batch_size": 3},
                "optimizer": {"name": "sgd", "lr": 1.0, "momentum": 0.0},
                "training": {"epochs": 1, "log_every": 1, "grad_accum_steps": accum, "max_grad_norm": 0.0},
            }
        )
        dtrain.Trainer(config, model=model, train_data=Listed(samples), eval_data=Listed(samples)).fit()
        if not dist.is_initialized() or dist.get_rank() == 0:
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"{name}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
