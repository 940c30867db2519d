"""Accelerate's `examples/nlp_example.py`, ported to dtrain: BERT fine-tuned for paraphrase detection on
GLUE MRPC, accuracy and F1 on the validation split after every epoch. The original is 210 lines (117 of
code, without comments and blank lines); this port is 99 (55 of code).

    pip install -e '.[hf]'
    dtrain launch --nproc 2 examples/accelerate_nlp_example.py [--model M] [--data D] [section.key=value ...]

The recipe is the original's: `bert-base-cased` and its tokenizer, sentence pairs tokenized with
truncation, batches padded to their longest sample by the user's collate_fn (to a multiple of 8 under mixed
precision), 16 samples a process (the last partial batch dropped) and 32 an eval batch, AdamW at 2e-5 with
torch's default weight decay (0.01, on every parameter), a linear schedule with 100 warm-up steps, 3
epochs, seed 42. `--model` and `--data` take local folders too (a model and tokenizer saved with
`save_pretrained`, a DatasetDict saved with `save_to_disk`): nothing else is downloaded.

What Accelerate's script does by hand and dtrain does itself: `accelerator.prepare` (DDP, the sampler,
device placement), the training and eval loops, `gather_for_metrics` (here `dtrain.whole_split`: every
validation pair scored once across the processes, no padding duplicates to guess away) and printing on the
main process (plus TensorBoard and metrics.jsonl). Its flags are config keys: `--mixed_precision bf16` is
`training.precision=bf16`, `--cpu` is `training.device=cpu`; `accelerate_by_feature.py` adds the
checkpointing and gradient accumulation flags of its `by_feature` siblings.

One difference in the schedule: Accelerate steps a prepared scheduler once per process at every optimizer
step, so its 100 warm-up "steps" end after 100 / processes optimizer steps, and the decay, sized from the
unsharded loader, likewise spans the run. dtrain counts optimizer steps: for the original's warm-up on N
processes, give `scheduler.warmup_steps=100/N`.
"""

import argparse
import os
from collections.abc import Sequence

import datasets
import torch
from sklearn.metrics import accuracy_score, f1_score
from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

import dtrain

RECIPE = [  # the original's hyper-parameters, as dtrain config keys
    "run.seed=42",
    "data.batch_size=16",  # per process (the original's MAX_GPU_BATCH_SIZE; more is training.grad_accum_steps)
    "data.eval_batch_size=32",
    "data.drop_last=true",  # its train DataLoader(drop_last=True)
    "optimizer.name=adamw",
    "optimizer.lr=2e-5",
    "optimizer.weight_decay=0.01",  # torch.optim.AdamW's default, which the original leaves on ...
    "optimizer.no_decay=[]",  # ... for every parameter (dtrain's default spares biases and norm weights)
    "scheduler.name=linear",  # get_linear_schedule_with_warmup
    "scheduler.warmup_steps=100",
    "training.epochs=3",
    "training.log_every=10",
]


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert-base-cased", help="a model name on the hub, or a local folder")
    parser.add_argument("--data", default="nyu-mll/glue", help="GLUE on the hub (its mrpc), or a saved DatasetDict")
    parser.add_argument("--run-dir", default="runs/accelerate_nlp")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="dtrain config overrides")
    return parser


def mrpc(predictions: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """GLUE's MRPC metric (what `evaluate.load("glue", "mrpc")` computes) over the whole validation split."""
    predicted = predictions.argmax(dim=-1)
    return {"accuracy": accuracy_score(labels, predicted), "f1": f1_score(labels, predicted)}


def train(args: argparse.Namespace, more: Sequence[str] = ()) -> None:
    config = dtrain.load_config(None, [*RECIPE, f"run.dir={args.run_dir}", *more, *args.overrides])
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    raw = datasets.load_from_disk(args.data) if os.path.isdir(args.data) else datasets.load_dataset(args.data, "mrpc")

    def tokenize(pairs):  # max_length=None: the model's own maximum
        return tokenizer(pairs["sentence1"], pairs["sentence2"], truncation=True, max_length=None)

    # Every process tokenizes (dtrain joins the process group in fit(), after this); datasets' cache files
    # are written whole, so processes that find the same cache entry read the same rows.
    tokenized = raw.map(tokenize, batched=True, remove_columns=["idx", "sentence1", "sentence2"])
    tokenized = tokenized.rename_column("label", "labels")  # the name transformers' models take
    # The original's collate_fn: pad to the batch's longest, to a multiple of 8 under mixed precision.
    multiple = None if config.training.precision == "fp32" else 8
    collate = DataCollatorWithPadding(tokenizer, padding="longest", pad_to_multiple_of=multiple, return_tensors="pt")

    torch.manual_seed(config.run.seed)  # set_seed before the model: the same classifier head on every rank
    model = AutoModelForSequenceClassification.from_pretrained(args.model)
    dtrain.Trainer(
        config,
        model=model,
        train_data=tokenized["train"],
        eval_data=tokenized["validation"],
        collate_fn=collate,
        eval_metrics=dtrain.whole_split(mrpc),  # logged as eval_accuracy and eval_f1 after every epoch
    ).fit()


if __name__ == "__main__":
    train(arguments().parse_args())
