"""A Hugging Face causal language model (the GPT-2 architecture, built from a GPT2Config: nothing is
downloaded) trained by dtrain on dict batches, through dtrain's launcher.

    pip install -e '.[hf]'
    dtrain prepare text --python-stdlib --out data/stdlib
    dtrain launch --nproc 2 examples/hf_causal_lm.py --data data/stdlib [section.key=value ...]

Each sample is {"input_ids": ..., "labels": ...}, as a Hugging Face tokenizer or collator makes it; the
model shifts the labels and returns .loss itself, and dtrain takes it from there (see dtrain/loss.py).
Everything else — DDP, the order of the windows, accumulation, exact eval (eval_loss over tokens and
eval_perplexity), checkpoints and exact resume, TensorBoard — is dtrain's, as for a built-in model.
"""

import argparse

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel

import dtrain
from dtrain.data.tokens import TokenWindows


class CausalLMSamples(Dataset):
    """Token windows as the dicts a Hugging Face causal LM takes."""

    global_order = True  # served in an order that does not depend on the number of processes

    def __init__(self, windows: TokenWindows):
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        inputs, _ = self.windows[index]  # the model shifts the labels by one itself
        return {"input_ids": inputs, "labels": inputs}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="data/stdlib", help="a folder made by `dtrain prepare text`")
    parser.add_argument("--run-dir", default="runs/hf_causal_lm")
    parser.add_argument("--width", type=int, default=128, help="n_embd of the model")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="dtrain config overrides")
    args = parser.parse_args()

    config = dtrain.load_config(
        None,
        [
            f"run.dir={args.run_dir}",
            "data.name=tokens",
            f"data.path={args.data}",
            "data.block_size=128",
            "data.batch_size=8",
            "optimizer.name=adamw",
            "optimizer.lr=0.001",
            "scheduler.name=cosine",
            "scheduler.warmup_steps=20",
            "training.epochs=1",
            "training.max_steps=200",
            "training.log_every=20",
            *args.overrides,
        ],
    )
    block = config.data.block_size
    train = TokenWindows(args.data, "train", block)
    val = TokenWindows(args.data, "val", block)
    torch.manual_seed(config.run.seed)  # the same initial weights on every rank
    eot = train.meta["eot_token"]
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=train.vocab_size,
            n_positions=block,
            n_embd=args.width,
            n_layer=args.layers,
            n_head=4,
            bos_token_id=eot,
            eos_token_id=eot,
        )
    )
    dtrain.Trainer(
        config, model=model, train_data=CausalLMSamples(train), eval_data=CausalLMSamples(val) if len(val) else None
    ).fit()


if __name__ == "__main__":
    main()
