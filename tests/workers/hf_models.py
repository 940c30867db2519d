"""A tiny Hugging Face causal LM — GPT-2 or Llama, built from a config (nothing downloaded) — trained by
`dtrain launch` on random tokens, as a user's script trains one.

    dtrain launch --nproc 2 tests/workers/hf_models.py gpt2|llama RUN_DIR [section.key=value ...]
"""

import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import dtrain

BLOCK, VOCAB = 16, 64


def tiny(kind: str) -> torch.nn.Module:
    """The same initial weights on every rank (and in the test that rebuilds it)."""
    torch.manual_seed(0)
    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=BLOCK, n_embd=16, n_layer=2, n_head=2))
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,  # grouped-query attention, as Llama's larger models
        max_position_embeddings=BLOCK,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config)


def samples(n: int) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (n, BLOCK), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


def main() -> None:
    kind, run_dir, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    config = dtrain.load_config(
        None,
        [
            f"run.dir={run_dir}",
            "data.batch_size=4",
            "optimizer.name=adamw",
            "optimizer.lr=0.01",
            "training.epochs=1",
            "training.max_steps=4",
            "training.log_every=2",
            "checkpoint.every_steps=2",
            *overrides,
        ],
    )
    dtrain.Trainer(config, model=tiny(kind), train_data=samples(32)).fit()


if __name__ == "__main__":
    main()
