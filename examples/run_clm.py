"""transformers' `examples/pytorch/language-modeling/run_clm_no_trainer.py`, ported to dtrain: a causal
language model (GPT-2 by default) fine-tuned on a text data set cut into blocks, perplexity on the
validation split after every epoch, checkpoints, resume, and the model saved as a Hugging Face folder. The
original is about 700 lines (Accelerate does its distribution); this port is 133 (77 of code, without
comments and blank lines).

    pip install -e '.[hf]'
    dtrain launch --nproc 2 examples/run_clm.py [--model M] [--data NAME --data-config C]
                  [--train-file F --validation-file F] [--block-size N] [--run-dir D] [section.key=value ...]

The recipe is the original's: texts tokenized and concatenated, cut into blocks of `--block-size` tokens
(the remainder of each 1,000 texts dropped), labels equal to the inputs (the model shifts them), a
validation split taken from the training data where there is none (`--validation-split-percentage`),
`default_data_collator`, AdamW at 5e-5 with no weight decay on biases and norm weights, transformers'
linear schedule, 3 epochs, 8 blocks a process. Its training flags are dtrain config keys:

| run_clm_no_trainer.py                       | dtrain                                                          |
| ------------------------------------------- | --------------------------------------------------------------- |
| `--per_device_train_batch_size 8`           | `data.batch_size=8`                                             |
| `--per_device_eval_batch_size 8`            | `data.eval_batch_size=8`                                        |
| `--learning_rate`, `--weight_decay`         | `optimizer.lr`, `optimizer.weight_decay`                        |
| `--num_train_epochs`, `--max_train_steps`   | `training.epochs`, `training.max_steps`                         |
| `--gradient_accumulation_steps`             | `training.grad_accum_steps` (or `training.global_batch_size`)   |
| `--lr_scheduler_type`, `--num_warmup_steps` | `scheduler.name`, `scheduler.warmup_steps` (optimizer steps)    |
| `--seed`                                    | `run.seed`                                                      |
| `--output_dir`                              | `--run-dir` (the model and tokenizer in run.dir/hf)             |
| `--checkpointing_steps N` / `epoch`         | `checkpoint.every_steps=N` / `checkpoint.every_epochs=1`        |
| `--resume_from_checkpoint PATH`             | `--resume-from PATH`; a rerun in the same run.dir resumes alone |
| `--with_tracking --report_to wandb`         | `monitor.trackers=["tensorboard","wandb"]`                      |

What the original does by hand and dtrain does itself: `accelerator.prepare`, the loops, the step counting
around accumulation, the warm-up multiplied by the number of processes (Accelerate steps the schedule once
per process), `gather_for_metrics` of the eval losses (dtrain's `eval_loss` is the mean over every target
token of the split, each once; its `eval_perplexity` is exp of it), saving and loading state, and skipping
the batches already trained when resuming. Not ported: `--model_type` / `--config_name` (training from
scratch), `--push_to_hub`, `--trust_remote_code`, `--low_cpu_mem_usage`.
"""

import argparse
import json
import os
from itertools import chain
from pathlib import Path

import datasets
from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator

import dtrain

RECIPE = [  # the original's defaults, as dtrain config keys
    "data.batch_size=8",
    "data.eval_batch_size=8",
    "optimizer.name=adamw",
    "optimizer.lr=5e-5",
    "optimizer.weight_decay=0.0",
    # Its no_decay: biases and norm weights (by name and LayerNorm class) — the parameters of fewer than two
    # dimensions, GPT-2's and Llama's alike.
    'optimizer.no_decay=["ndim<2"]',
    "scheduler.name=linear",
    "scheduler.warmup_steps=0",
    "training.epochs=3",
    "training.log_every=10",
    "checkpoint.export=hf",  # save_pretrained at the end: run.dir/hf
]


def raw_datasets(args: argparse.Namespace) -> datasets.DatasetDict:
    """The text: a data set on the hub, or local txt / csv / json files, with a validation split."""
    if args.train_file:
        files = {"train": args.train_file, **({"validation": args.validation_file} if args.validation_file else {})}
        extension = args.train_file.rsplit(".", 1)[-1]
        builder, options = ("text" if extension == "txt" else extension), {"data_files": files}
    else:
        builder, options = args.data, {"name": args.data_config}
    raw = datasets.load_dataset(builder, **options)
    if "validation" not in raw:  # the first --validation-split-percentage of the training texts
        cut = args.validation_split_percentage
        raw["validation"] = datasets.load_dataset(builder, split=f"train[:{cut}%]", **options)
        raw["train"] = datasets.load_dataset(builder, split=f"train[{cut}%:]", **options)
    return raw


def blocks(raw: datasets.DatasetDict, tokenizer, block_size: int) -> datasets.DatasetDict:
    """Tokenize every text, concatenate them and cut the stream into blocks of `block_size` tokens."""
    columns = raw["train"].column_names
    text = "text" if "text" in columns else columns[0]
    tokenized = raw.map(lambda texts: tokenizer(texts[text]), batched=True, remove_columns=columns)

    def group_texts(examples):
        joined = {k: list(chain(*examples[k])) for k in examples}
        total = len(joined["input_ids"]) // block_size * block_size  # the remainder is dropped
        result = {k: [t[i : i + block_size] for i in range(0, total, block_size)] for k, t in joined.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    return tokenized.map(group_texts, batched=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="openai-community/gpt2", help="a model on the hub, or a local folder")
    parser.add_argument("--data", default="Salesforce/wikitext", help="a data set on the hub")
    parser.add_argument("--data-config", default="wikitext-2-raw-v1", help="its configuration")
    parser.add_argument("--train-file", help="local text instead: a .txt, .csv or .json file")
    parser.add_argument("--validation-file")
    parser.add_argument("--validation-split-percentage", type=int, default=5)
    parser.add_argument("--block-size", type=int, help="tokens a block (default: the model's, at most 1024)")
    parser.add_argument("--run-dir", default="runs/run_clm")
    parser.add_argument("--resume-from", help="start from this checkpoint (a step-N folder, or a run.dir)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="dtrain config overrides")
    args = parser.parse_args()
    resume = [f"checkpoint.resume_from={json.dumps(args.resume_from)}"] if args.resume_from else []
    config = dtrain.load_config(None, [*RECIPE, f"run.dir={args.run_dir}", *resume, *args.overrides])

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))
    longest = min(tokenizer.model_max_length, model.config.max_position_embeddings)
    block_size = min(args.block_size or 1024, longest)
    lm = blocks(raw_datasets(args), tokenizer, block_size)

    dtrain.Trainer(
        config, model=model, train_data=lm["train"], eval_data=lm["validation"], collate_fn=default_data_collator
    ).fit()
    # dtrain exports the model (checkpoint.export = "hf"); the tokenizer beside it is the script's to save.
    export = Path(config.run.dir) / "hf"
    if os.environ.get("RANK", "0") == "0" and export.is_dir():
        tokenizer.save_pretrained(export)


if __name__ == "__main__":
    main()
