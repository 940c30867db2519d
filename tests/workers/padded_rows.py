"""Rows of different lengths padded per batch (data.padding = longest), trained by `dtrain launch`:

    dtrain launch --nproc 2 tests/workers/padded_rows.py OUT [section.key=value ...]

A `datasets.Dataset` of tokenized rows (Python lists of 3 to 16 tokens, each counting up from a random
start: a pattern to learn) and a tiny Hugging Face GPT-2 whose config names pad token 0. The run is
OUT/run; rank 0 writes OUT/lengths.json, every row's length in the data set's order. Nothing is downloaded.
"""

import json
import os
import sys
from pathlib import Path

import datasets
import torch
from hf_gpt2 import BLOCK, VOCAB, tiny_gpt2

import dtrain

N = 32


def rows() -> dict[str, list]:
    g = torch.Generator().manual_seed(2)
    lengths = torch.randint(3, BLOCK + 1, (N,), generator=g).tolist()
    starts = torch.randint(1, VOCAB, (N,), generator=g).tolist()
    return {"input_ids": [[(s + i) % VOCAB for i in range(n)] for s, n in zip(starts, lengths)]}


def main() -> None:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    config = dtrain.load_config(
        None,
        [
            f"run.dir={out / 'run'}",
            "data.batch_size=4",
            "data.padding=longest",
            "data.shuffle=false",
            "optimizer.name=adamw",
            "optimizer.lr=0.01",
            "training.epochs=4",
            "training.log_every=1",
            "monitor.trackers=[]",
            *overrides,
        ],
    )
    table = rows()
    model = tiny_gpt2()
    model.config.pad_token_id = 0
    dtrain.Trainer(config, model=model, train_data=datasets.Dataset.from_dict(table)).fit()
    if os.environ.get("RANK", "0") == "0":
        (out / "lengths.json").write_text(json.dumps([len(r) for r in table["input_ids"]]))


if __name__ == "__main__":
    main()
