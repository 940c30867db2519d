"""The `dtrain` command line.

    dtrain run CONFIG [--resume | --resume-from PATH] [--nproc N] [--nnodes N] [--node-rank R]
                      [--rdzv-endpoint HOST:PORT] [--rdzv-timeout S] [--rdzv-last-call S]
                      [--max-restarts R] [--local-addr ADDR] [section.key=value ...]
    dtrain launch [same launch flags] SCRIPT.py [script args ...]
    dtrain config [CONFIG] [section.key=value ...]     print the resolved config
    dtrain config --reference                         every key, its default and meaning
    dtrain doctor [--nproc N ...]                     environment report; collectives' bandwidth
    dtrain report RUN_DIR                             plots and a summary of a run
    dtrain prepare text SRC... --out DIR              text files → token shards (data.name=tokens)
    dtrain generate RUN_DIR --prompt TEXT             a sample from a trained language model
    dtrain eval RUN_DIR [--step N] [--nproc N] [--out FILE] [section.key=value ...]
                                                      a checkpoint's eval metrics, without training
    dtrain export RUN_DIR --format hf [--step N] [--merged]   the weights as a Hugging Face model folder
                                                      (RUN_DIR and --out may be s3:// URLs)

`dtrain run` is both the launcher and the worker: started by hand it starts torchrun, which starts
`python -m dtrain run ...` again in every worker; a worker (torchrun, srun or mpirun set its rank)
trains.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Sequence

from dtrain import __version__, console, early_stop
from dtrain.config import check_model_fits_data, idle_settings, read_config
from dtrain.errors import EXIT_INTERRUPTED, EXIT_REQUEUE, EXIT_USAGE, DtrainError
from dtrain.rundir import refuse_given_in_code

# torch is imported only after the command line and config have been checked, so that a typo is
# answered at once rather than after seconds of imports.

LAUNCH_FLAGS = (
    "nproc",
    "nnodes",
    "node_rank",
    "rdzv_endpoint",
    "rdzv_id",
    "rdzv_timeout",
    "rdzv_last_call",
    "max_restarts",
    "local_addr",
)


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage mistake said in one line (exit 2) like every other bad input."""

    def error(self, message: str):
        raise DtrainError(f"{self.prog}: {message} (see {self.prog} --help)")


def _add_launch_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("launch (passed to torchrun)")
    g.add_argument(
        "--nproc", type=int, default=None, metavar="N", help="worker processes on this node (one per GPU; default 1)"
    )
    g.add_argument("--nnodes", default=None, metavar="N|MIN:MAX", help="nodes in the job (default 1)")
    g.add_argument(
        "--node-rank",
        type=int,
        default=None,
        metavar="R",
        help="this node's fixed rank (static rendezvous); omit for elastic c10d rendezvous",
    )
    g.add_argument(
        "--rdzv-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="rendezvous address on the first node, reachable from every node",
    )
    g.add_argument("--rdzv-id", default=None, metavar="ID", help="job id shared by all nodes (default dtrain)")
    g.add_argument(
        "--rdzv-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long a node waits for the rendezvous and the other nodes (default 600)",
    )
    g.add_argument(
        "--rdzv-last-call",
        type=int,
        default=None,
        metavar="SECONDS",
        help="elastic jobs (--nnodes MIN:MAX): once MIN nodes are in, how long the group waits for more "
        "before it starts or restarts (default 30, torchrun's)",
    )
    g.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        metavar="R",
        help="restart the whole group up to R times when a worker fails (default 0); "
        "restarts resume from the newest checkpoint",
    )
    g.add_argument(
        "--local-addr",
        default=None,
        metavar="ADDR",
        help="this node's address as the other nodes reach it (default: worked out from the route to --rdzv-endpoint)",
    )


def _spec(args: argparse.Namespace):
    from dtrain.launch import LaunchSpec

    spec = LaunchSpec()
    for name in LAUNCH_FLAGS:
        value = getattr(args, name)
        if value is not None:
            setattr(spec, name, value)
    return spec


def _explicit_launch(args: argparse.Namespace) -> bool:
    return any(getattr(args, name) is not None for name in LAUNCH_FLAGS)


def _say_notes(notes: list[str]) -> None:
    """What loading the config noted (a renamed key, settings that do nothing), said once per job: by the
    launcher, or by rank 0 where something else started every worker; never by torchrun's workers, which
    load it again."""
    if not notes or "TORCHELASTIC_RUN_ID" in os.environ:
        return
    from dtrain.distributed import detect_env, in_worker_environment

    if in_worker_environment() and detect_env().rank != 0:
        return
    for note in notes:
        print(f"note: {note}", file=sys.stderr)


def cmd_run(argv: Sequence[str]) -> int:
    parser = _Parser(prog="dtrain run", description="Train the job a TOML config describes.")
    parser.add_argument("config", help="TOML job description, e.g. examples/digits_mlp.toml")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in run.dir (checkpoint.resume=yes)",
    )
    parser.add_argument(
        "--resume-from",
        metavar="PATH",
        help="start from this checkpoint (a step-N folder, or a run.dir: its newest) of this or another run, read "
        "where it is (checkpoint.resume_from=PATH)",
    )
    _add_launch_flags(parser)
    args = parser.parse_intermixed_args(argv)
    overrides = [*args.overrides, *(["checkpoint.resume=yes"] if args.resume else [])]
    if args.resume_from is not None and not args.resume_from.strip():  # an unset `--resume-from "$CKPT"`
        parser.error("--resume-from is empty; give a step-N folder or a run.dir")
    if args.resume_from is not None:  # a TOML string, whatever the path holds
        overrides.append(f"checkpoint.resume_from={json.dumps(args.resume_from)}")
    config, notes = read_config(args.config, overrides)
    refuse_given_in_code(args.config)
    _say_notes([*notes, *idle_settings(config)])
    from dtrain import distributed
    from dtrain.distributed import in_worker_environment
    from dtrain.launch import launch
    from dtrain.launch.preflight import preflight

    # Inside torchrun: a worker. RANK/WORLD_SIZE (or srun's, mpirun's variables) without launch flags:
    # a worker started by something else (it waits for its peers in distributed.start, saying so). With
    # launch flags dtrain launches, whatever the environment says (a Kubernetes PyTorchJob pod sets RANK
    # and WORLD_SIZE for the pod; torchrun sets the workers').
    if "TORCHELASTIC_RUN_ID" in os.environ or (in_worker_environment() and not _explicit_launch(args)):
        from dtrain.worker import worker_main

        return worker_main(config)

    distributed.keep_to_the_cpu(config.training.device)  # before anything here or in a worker asks CUDA
    spec = _spec(args)
    spec.shutdown_grace_s = config.checkpoint.preempt_grace_s
    spec.validate()
    # The largest group the job may form: an elastic range (--nnodes MIN:MAX) can grow to MAX nodes.
    done = preflight(
        config, world_size=spec.nproc * spec.max_nodes, local_world_size=spec.nproc, config_file=args.config
    )
    if done:  # a finished run rerun: said once, nothing started
        print(f"dtrain: {done}", file=sys.stderr)
        return 0
    if spec.nproc == 1 and not spec.multi_node and spec.max_restarts == 0:
        from dtrain.worker import worker_main  # the trainer: only where this process trains

        return worker_main(config)  # one process: no launcher needed
    return launch(spec, ["-m", "dtrain", "run", args.config, *overrides])


def cmd_launch(argv: Sequence[str]) -> int:
    parser = _Parser(
        prog="dtrain launch",
        description="Run your own training script (using dtrain.Trainer or plain "
        "torch.distributed) in every worker, through torchrun; in a pod (RANK and WORLD_SIZE set, no "
        "launch flags), run it here as that pod's worker.",
    )
    _add_launch_flags(parser)
    parser.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name (python -m)")
    parser.add_argument("script", help="the script every worker runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    args = parser.parse_args(argv)
    if not args.module and not os.path.isfile(args.script):
        raise DtrainError(f"script {args.script} does not exist")
    script = [*(["-m"] if args.module else []), args.script, *args.script_args]
    from dtrain.distributed import in_worker_environment

    if in_worker_environment() and not _explicit_launch(args):
        # As `dtrain run`: RANK/WORLD_SIZE without launch flags (a pod, an srun task) make this process
        # one worker of the job they describe — not the only worker of a world of its own.
        from dtrain.worker import script as worker_script

        return worker_script.main(script)
    # Each worker runs the script through dtrain.script: its failures are then reported once.
    from dtrain.launch import launch

    return launch(_spec(args), ["-m", "dtrain.worker.script", *script])


def cmd_config(argv: Sequence[str]) -> int:
    parser = _Parser(prog="dtrain config", description="Print the resolved config as TOML.")
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
    _say_notes([*notes, *idle_settings(config)])
    sys.stdout.write(config.to_toml())
    return 0


def cmd_doctor(argv: Sequence[str]) -> int:
    parser = _Parser(
        prog="dtrain doctor",
        description="Report this machine's distributed set-up and what looks wrong; "
        "with --nproc, measure real all-reduce, all-gather and reduce-scatter across the group "
        "(1 KiB to 256 MiB).",
    )
    _add_launch_flags(parser)
    parser.add_argument("--iters", type=int, default=3, help="timed rounds of each collective per size (default 3)")
    parser.add_argument("--max-mib", type=int, default=256, help="largest buffer measured, in MiB (default 256)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from dtrain.commands import doctor

    if args.worker or "TORCHELASTIC_RUN_ID" in os.environ:
        return doctor.bandwidth_worker(args.iters, args.max_mib)
    status = doctor.main_report(args.nproc or 1)
    if not _explicit_launch(args):
        return status
    from dtrain.launch import launch

    print(flush=True)
    worker = ["-m", "dtrain", "doctor", "--worker", "--iters", str(args.iters), "--max-mib", str(args.max_mib)]
    return launch(_spec(args), worker) or status


def cmd_report(argv: Sequence[str]) -> int:
    parser = _Parser(prog="dtrain report", description="Plots and a summary of a run, written to RUN_DIR/report/.")
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


class _Stopped:
    """SIGTERM while a command writes `out` (prepare, export): unwind (exit 75, one line), so that nothing
    of `out` is left behind. The early handler would end the process at once (os._exit), leaving the
    staging folder beside `out`. Raised where the signal lands, the error may come back wrapped (DCP wraps
    what its read raises): `fired` tells the command to say this line all the same."""

    def __init__(self, out: str, what: str):
        self.error = DtrainError(f"stopped by SIGTERM; nothing was written to {out} — rerun the same command to {what}")
        self.error.exit_code = EXIT_REQUEUE
        self.fired = False

    def __call__(self, signum: int, frame: object) -> None:
        self.fired = True
        raise self.error


def cmd_prepare(argv: Sequence[str]) -> int:
    parser = _Parser(
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

    signal.signal(signal.SIGTERM, _Stopped(args.out, "prepare it"))
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
    parser = _Parser(prog="dtrain generate", description="Print a sample from a language model a run trained.")
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
    parser = _Parser(
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

    stopped = _Stopped(args.out or os.path.join(args.run_dir, "hf"), "export it")
    signal.signal(signal.SIGTERM, stopped)
    try:
        print(export(args.run_dir, args.format, args.out, args.step, args.max_shard_size, args.merged))
    except BaseException:  # DCP's CheckpointException, which wraps the signal's error, is a BaseException
        if stopped.fired:
            raise stopped.error from None
        raise
    return 0


def cmd_eval(argv: Sequence[str]) -> int:
    parser = _Parser(
        prog="dtrain eval",
        description="Evaluate a checkpoint of a run without training: the run's own evaluation, rebuilt from "
        "its config.toml, printed in one line. Reads only: a run still training goes on undisturbed.",
    )
    parser.add_argument("run_dir", help="a run's run.dir (or its URL), of a run `dtrain run CONFIG` trained")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="overrides of the run's config")
    parser.add_argument(
        "--step", type=int, default=None, metavar="N", help="checkpoint step-N (default: the newest complete one)"
    )
    parser.add_argument("--out", default=None, metavar="FILE", help="also write the metrics as JSON (outside RUN_DIR)")
    parser.add_argument("--final", action="store_true", help=argparse.SUPPRESS)  # the launcher chose the final weights
    parser.add_argument("--shown", default=None, help=argparse.SUPPRESS)  # the URL a local copy stands for
    _add_launch_flags(parser)
    args = parser.parse_intermixed_args(argv)
    from pathlib import Path

    from dtrain import objstore
    from dtrain.commands import evaluate

    if not args.run_dir.strip():  # an unset shell variable: never "." by accident
        raise DtrainError("RUN_DIR is empty (an unset shell variable?); give the run.dir of a dtrain run")
    if args.step is not None and args.step < 0:
        raise DtrainError(f"--step must be a checkpoint's step (a whole number >= 0); got {args.step}")
    shown = args.shown or args.run_dir
    if not objstore.is_url(args.run_dir):  # not a run.dir, a bad override: said before torch is imported
        read_config(str(evaluate.config_of(Path(args.run_dir), shown)), args.overrides)
    from dtrain.distributed import in_worker_environment
    from dtrain.worker import as_worker

    if "TORCHELASTIC_RUN_ID" in os.environ or (in_worker_environment() and not _explicit_launch(args)):
        run_dir = Path(args.run_dir)  # a worker: the launcher chose the weights (or, started by srun, it does)
        choice = evaluate.Choice(None, run_dir / "model.safetensors") if args.final else None
        return as_worker(
            lambda: evaluate.main(
                run_dir, choice or evaluate.choose(run_dir, args.step, shown), args.overrides, shown, args.out
            )
        )
    if objstore.is_url(args.run_dir):  # read through a local copy of what eval needs, no lease taken
        from dtrain.rundir import reading

        with reading.fetched(args.run_dir, "checkpoint", args.step) as copy:
            return _eval_here(args, copy.path, shown)
    return _eval_here(args, Path(args.run_dir), shown)


def _eval_here(args: argparse.Namespace, run_dir, shown: str) -> int:
    """The launcher of `dtrain eval`: check and choose here, once, then evaluate in 1 or --nproc processes."""
    from dtrain import distributed
    from dtrain.commands import evaluate
    from dtrain.worker import as_worker

    config, notes = read_config(str(evaluate.config_of(run_dir, shown)), args.overrides)
    _say_notes(notes)
    choice = evaluate.choose(run_dir, args.step, shown)
    evaluate.check_intact(run_dir, choice)
    evaluate.check_out(args.out, run_dir)
    distributed.keep_to_the_cpu(config.training.device)
    spec = _spec(args)
    spec.validate()
    if spec.nproc == 1 and not spec.multi_node:
        overrides = [*args.overrides, *evaluate.unsplit(config, shown)]
        return as_worker(lambda: evaluate.main(run_dir, choice, overrides, shown, args.out))
    from dtrain.launch import launch

    which = ["--step", str(choice.step)] if choice.step is not None else ["--final"]
    out = ["--out", args.out] if args.out is not None else []
    return launch(spec, ["-m", "dtrain", "eval", str(run_dir), *which, *out, "--shown", shown, *args.overrides])


COMMANDS = {
    "run": cmd_run,
    "launch": cmd_launch,
    "config": cmd_config,
    "doctor": cmd_doctor,
    "report": cmd_report,
    "prepare": cmd_prepare,
    "generate": cmd_generate,
    "export": cmd_export,
    "eval": cmd_eval,
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Before torch is imported: SIGTERM in the first second still exits 75; Ctrl-C before a run's first step, 130.
    early_stop.install(interrupt=argv[:1] == ["run"])
    console.outlive_the_reader()  # a run stopped with its `| tee` must still write its checkpoint
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else EXIT_USAGE
    if argv[0] == "--version":
        print(f"dtrain {__version__}")
        return 0
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"dtrain: error: unknown command '{argv[0]}'; use one of {', '.join(COMMANDS)}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return command(argv[1:])
    except DtrainError as exc:
        print(f"dtrain: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except KeyboardInterrupt:  # before any worker started (a run's workers stop with a checkpoint)
        line = early_stop.NOTHING_TO_SAVE_INTERRUPTED if argv[0] == "launch" else "interrupted (Ctrl-C)"
        print(f"dtrain: {line}", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
