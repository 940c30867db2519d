"""A tiny Hugging Face GPT-2 trained by `dtrain launch` on dict batches, as its users write the script.

    dtrain launch --nproc 2 tests/workers/hf_gpt2.py OUT [section.key=value ...]

The run is OUT/run; rank 0 writes OUT/facts.json: what the trained model says of itself (is it checkpointing its
activations, which of its blocks dtrain wrapped) and the loss. Random tokens: nothing is downloaded.
"""

import json
import os
import sys
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import dtrain

BLOCK, VOCAB = 16, 64


def tiny_gpt2() -> GPT2LMHeadModel:
    """GPT-2 with its lm_head tied to the token embedding (wte), as GPT-2 is."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=BLOCK, n_embd=16, n_layer=2, n_head=2)
    return GPT2LMHeadModel(config)


def samples(n: int) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (n, BLOCK), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


def main() -> None:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    config = dtrain.load_config(
        None,
        [
            f"run.dir={out / 'run'}",
            "data.batch_size=4",
            "optimizer.lr=0.01",
            "training.epochs=1",
            "training.max_steps=3",
            "training.log_every=1",
            *overrides,
        ],
    )
    model = tiny_gpt2()
    result = dtrain.Trainer(config, model=model, train_data=samples(32)).fit()
    if os.environ.get("RANK", "0") != "0":
        return
    blocks = list(model.transformer.h)
    facts = {
        "checkpointing": bool(
            model.is_activation_checkpointing  # the newer name: the old one warns
            if hasattr(model, "is_activation_checkpointing")
            else model.is_gradient_checkpointing
        ),
        "blocks_checkpointing": [bool(block.gradient_checkpointing) for block in blocks],
        # dtrain's own wrapping replaces a block's forward on the instance; the model's own does not.
        "forward_replaced": ["forward" in vars(block) for block in blocks],
        "use_cache": model.config.use_cache,
        "loss": result.get("loss"),
    }
    (out / "facts.json").write_text(json.dumps(facts))


if __name__ == "__main__":
    main()
