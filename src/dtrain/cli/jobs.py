"""The commands that start workers: `dtrain run`, `dtrain launch`, `dtrain eval` and `dtrain doctor` — each
the launcher when started by hand, and the worker in a process torchrun (or srun, mpirun) started."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from dtrain.cli.flags import Parser, add_launch_flags, explicit_launch, launch_spec, say_notes
from dtrain.config import idle_settings, read_config
from dtrain.errors import DtrainError
from dtrain.placement import in_worker_environment, is_torchrun_worker
from dtrain.rundir import refuse_given_in_code


def cmd_run(argv: Sequence[str]) -> int:
    parser = Parser(prog="dtrain run", description="Train the job a TOML config describes.")
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
    add_launch_flags(parser)
    args = parser.parse_intermixed_args(argv)
    overrides = [*args.overrides, *(["checkpoint.resume=yes"] if args.resume else [])]
    if args.resume_from is not None and not args.resume_from.strip():  # an unset `--resume-from "$CKPT"`
        parser.error("--resume-from is empty; give a step-N folder or a run.dir")
    if args.resume_from is not None:  # a TOML string, whatever the path holds
        overrides.append(f"checkpoint.resume_from={json.dumps(args.resume_from)}")
    config, notes = read_config(args.config, overrides)
    refuse_given_in_code(args.config)
    say_notes([*notes, *idle_settings(config)])
    from dtrain import distributed
    from dtrain.launch import launch
    from dtrain.launch.preflight import preflight

    # Inside torchrun: a worker. RANK/WORLD_SIZE (or srun's, mpirun's variables) without launch flags:
    # a worker started by something else (it waits for its peers in distributed.start, saying so). With
    # launch flags dtrain launches, whatever the environment says (a Kubernetes PyTorchJob pod sets RANK
    # and WORLD_SIZE for the pod; torchrun sets the workers').
    if is_torchrun_worker() or (in_worker_environment() and not explicit_launch(args)):
        from dtrain.worker import worker_main

        return worker_main(config)

    distributed.keep_to_the_cpu(config.training.device)  # before anything here or in a worker asks CUDA
    spec = launch_spec(args)
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
    parser = Parser(
        prog="dtrain launch",
        description="Run your own training script (using dtrain.Trainer or plain "
        "torch.distributed) in every worker, through torchrun; in a pod (RANK and WORLD_SIZE set, no "
        "launch flags), run it here as that pod's worker.",
    )
    add_launch_flags(parser)
    parser.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name (python -m)")
    parser.add_argument("script", help="the script every worker runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    args = parser.parse_args(argv)
    if not args.module and not os.path.isfile(args.script):
        raise DtrainError(f"script {args.script} does not exist")
    script = [*(["-m"] if args.module else []), args.script, *args.script_args]

    if in_worker_environment() and not explicit_launch(args):
        # As `dtrain run`: RANK/WORLD_SIZE without launch flags (a pod, an srun task) make this process
        # one worker of the job they describe — not the only worker of a world of its own.
        from dtrain.worker import script as worker_script

        return worker_script.main(script)
    # Each worker runs the script through dtrain.script: its failures are then reported once.
    from dtrain.launch import launch

    return launch(launch_spec(args), ["-m", "dtrain.worker.script", *script])


def cmd_doctor(argv: Sequence[str]) -> int:
    parser = Parser(
        prog="dtrain doctor",
        description="Report this machine's distributed set-up and what looks wrong; "
        "with --nproc, measure real all-reduce, all-gather and reduce-scatter across the group "
        "(1 KiB to 256 MiB).",
    )
    add_launch_flags(parser)
    parser.add_argument("--iters", type=int, default=3, help="timed rounds of each collective per size (default 3)")
    parser.add_argument("--max-mib", type=int, default=256, help="largest buffer measured, in MiB (default 256)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from dtrain.commands import doctor

    if args.worker or is_torchrun_worker():
        return doctor.bandwidth_worker(args.iters, args.max_mib)
    status = doctor.main_report(args.nproc or 1)
    if not explicit_launch(args):
        return status
    from dtrain.launch import launch

    print(flush=True)
    worker = ["-m", "dtrain", "doctor", "--worker", "--iters", str(args.iters), "--max-mib", str(args.max_mib)]
    return launch(launch_spec(args), worker) or status


def cmd_eval(argv: Sequence[str]) -> int:
    parser = Parser(
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
    add_launch_flags(parser)
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
    from dtrain.worker import as_worker

    if is_torchrun_worker() or (in_worker_environment() and not explicit_launch(args)):
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
    say_notes(notes)
    choice = evaluate.choose(run_dir, args.step, shown)
    evaluate.check_intact(run_dir, choice)
    evaluate.check_out(args.out, run_dir)
    distributed.keep_to_the_cpu(config.training.device)
    spec = launch_spec(args)
    spec.validate()
    if spec.nproc == 1 and not spec.multi_node:
        overrides = [*args.overrides, *evaluate.unsplit(config, shown)]
        return as_worker(lambda: evaluate.main(run_dir, choice, overrides, shown, args.out))
    from dtrain.launch import launch

    which = ["--step", str(choice.step)] if choice.step is not None else ["--final"]
    out = ["--out", args.out] if args.out is not None else []
    return launch(spec, ["-m", "dtrain", "eval", str(run_dir), *which, *out, "--shown", shown, *args.overrides])
