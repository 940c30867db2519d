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

import sys
from collections.abc import Sequence

from dtrain import __version__, console, early_stop
from dtrain.cli.files import cmd_config, cmd_export, cmd_generate, cmd_prepare, cmd_report
from dtrain.cli.jobs import cmd_doctor, cmd_eval, cmd_launch, cmd_run
from dtrain.errors import EXIT_INTERRUPTED, EXIT_USAGE, DtrainError

# torch is imported only after the command line and config have been checked, so that a typo is
# answered at once rather than after seconds of imports.


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
