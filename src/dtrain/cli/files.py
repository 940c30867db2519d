"""The commands on a run's files and data, which start no worker: `dtrain config`, `report`, `prepare`,
`generate` and `export`."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

from dtrain.cli.flags import Parser, Stopped, say_notes
from dtrain.config import check_model_fits_data, idle_settings, read_config
from dtrain.errors import DtrainError


def cmd_config(argv: Sequence[str]) -> int:
    parser = Parser(prog="dtrain config", description="Print the resolved config as TOML.")
    parser.add_argument("config", nargs="?", help="TOML job description (default: all defaults)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    parser.add_argument(
        "--reference", action="store_true", help="print every key with its default and meaning as a Markdown table"
    )
    args = parser.parse_intermixed_args(argv)
    if args.reference:
        from dtrain.config import reference_rows

        print("| key | default | meaning |\n| --- | --- | --- |")
        for key, default, help_ in reference_rows():
            print(f"| `{key}` | `{default}` | {help_} |")
        return 0
    if args.config and "=" in args.config and not os.path.exists(args.config):
        args.overrides.insert(0, args.config)
        args.config = None
    config, notes = read_config(args.config, args.overrides)
    check_model_fits_data(config)  # as `dtrain run` would
    say_notes([*notes, *idle_settings(config)])
    sys.stdout.write(config.to_toml())
    return 0


def cmd_report(argv: Sequence[str]) -> int:
    parser = Parser(prog="dtrain report", description="Plots and a summary of a run, written to RUN_DIR/report/.")
    parser.add_argument(
        "run_dir", help="a run.dir a dtrain run wrote metrics.jsonl to (or its URL: the report is written locally)"
    )
    args = parser.parse_args(argv)
    from pathlib import Path

    from dtrain import objstore
    from dtrain.commands.report import write_report

    if objstore.is_url(args.run_dir):  # its metrics copied down; the report kept in a folder of this machine
        from dtrain.rundir import reading

        with reading.fetched(args.run_dir, "none", into=reading.report_folder(args.run_dir)) as copy:
            out = write_report(copy.path)
    else:
        out = write_report(Path(args.run_dir))
    print((out / "summary.txt").read_text(), end="")
    print(f"plots: {', '.join(sorted(p.name for p in out.glob('*.png')))} in {out}")
    return 0


def cmd_prepare(argv: Sequence[str]) -> int:
    parser = Parser(
        prog="dtrain prepare", description="Turn text into token shards for data.name=tokens (see data/tokens.py)."
    )
    kinds = parser.add_subparsers(dest="kind", required=True, metavar="text")
    text = kinds.add_parser("text", help="text files, folders or globs → DIR/meta.json and DIR/*.bin")
    text.add_argument("sources", nargs="*", metavar="SRC", help="files, folders (searched recursively) or globs")
    text.add_argument("--out", required=True, metavar="DIR", help="a new folder for the shards")
    text.add_argument(
        "--python-stdlib",
        action="store_true",
        help="take the running Python's standard-library source as the corpus (no download)",
    )
    text.add_argument(
        "--tokenizer",
        default="bpe",
        metavar="bpe|bytes|FILE.json",
        help="bpe: a byte-level BPE trained on the training documents (default); bytes: one token "
        "per byte; or a Hugging Face tokenizer.json",
    )
    text.add_argument("--vocab-size", type=int, default=4096, metavar="N", help="BPE vocabulary (default 4096)")
    text.add_argument(
        "--val-fraction",
        type=float,
        default=0.05,
        metavar="F",
        help="share of documents held out for evaluation (default 0.05)",
    )
    text.add_argument("--workers", type=int, default=0, metavar="N", help="threads that tokenize (default: all cores)")
    text.add_argument("--dtype", default="auto", metavar="auto|uint16|uint32", help="token type on disk")
    args = parser.parse_args(argv)
    if not args.sources and not args.python_stdlib:
        raise DtrainError("dtrain prepare text needs SRC files or folders, or --python-stdlib")
    if args.workers < 0:
        raise DtrainError(f"--workers must be 0 (all cores) or more; got {args.workers}")
    if args.workers:  # tokenizers' threads (Rust's rayon): read once, when the first of them starts
        os.environ["RAYON_NUM_THREADS"] = str(args.workers)
    from dtrain.data.prepare import prepare_text

    signal.signal(signal.SIGTERM, Stopped(args.out, "prepare it"))
    meta = prepare_text(
        args.sources,
        args.out,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        val_fraction=args.val_fraction,
        python_stdlib=args.python_stdlib,
        dtype=args.dtype,
    )
    splits, source = meta["splits"], meta["source"]
    skipped = f" ({source['skipped']:,} files skipped: empty or not UTF-8 text)" if source["skipped"] else ""
    print(
        f"{args.out}: {splits['train']['tokens']:,} training and {splits['val']['tokens']:,} held-out tokens "
        f"from {source['documents']:,} documents{skipped}; vocabulary {meta['vocab_size']:,} ({meta['tokenizer']}), "
        f"{meta['dtype']}. Train with data.name=tokens data.path={args.out}"
    )
    if not splits["val"]["tokens"]:
        print(
            "note: nothing was held out (one document, or --val-fraction 0): runs on it will not evaluate",
            file=sys.stderr,
        )
    return 0


def cmd_generate(argv: Sequence[str]) -> int:
    parser = Parser(prog="dtrain generate", description="Print a sample from a language model a run trained.")
    parser.add_argument(
        "run_dir",
        help="a run's run.dir (or its URL): its model.safetensors, or its newest checkpoint where that is newer",
    )
    parser.add_argument("--prompt", default="", help="text to continue")
    parser.add_argument("--tokens", type=int, default=200, help="tokens to generate (default 200)")
    parser.add_argument(
        "--temperature", type=float, default=0.8, help="0: the likeliest token each time (greedy); default 0.8"
    )
    parser.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from dtrain.commands.generate import generate

    print(generate(args.run_dir, args.prompt, args.tokens, args.temperature, args.top_k, args.seed))
    return 0


def cmd_export(argv: Sequence[str]) -> int:
    parser = Parser(
        prog="dtrain export",
        description="Write a run's weights as a Hugging Face model folder (config.json, safetensors, tokenizer) "
        "that transformers' AutoModelForCausalLM.from_pretrained loads.",
    )
    parser.add_argument("run_dir", help="a run's run.dir (or its URL): the built-in gpt or a Hugging Face model")
    parser.add_argument("--format", required=True, metavar="hf", help="hf: a Hugging Face model folder")
    parser.add_argument(
        "--step", type=int, default=None, metavar="N", help="checkpoint step-N instead of the final weights"
    )
    parser.add_argument(
        "--out", default=None, metavar="DIR", help="the folder (or s3:// prefix) to write (default RUN_DIR/hf)"
    )
    parser.add_argument(
        "--max-shard-size",
        default="",
        metavar="SIZE",
        help="weights past this size are split into files with an index (default 50GB, as transformers)",
    )
    parser.add_argument(
        "--merged",
        action="store_true",
        help="a LoRA run: the base model with the adapters merged in (default: the PEFT adapter folder)",
    )
    args = parser.parse_args(argv)
    from dtrain.commands.export import export

    stopped = Stopped(args.out or os.path.join(args.run_dir, "hf"), "export it")
    signal.signal(signal.SIGTERM, stopped)
    try:
        print(export(args.run_dir, args.format, args.out, args.step, args.max_shard_size, args.merged))
    except BaseException:  # DCP's CheckpointException, which wraps the signal's error, is a BaseException
        if stopped.fired:
            raise stopped.error from None
        raise
    return 0
