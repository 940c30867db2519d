"""One worker process: a config-described job's run (session, data, model, Trainer), and the wrapper that
turns any worker's failure into one report and its exit status."""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch

from dtrain import data, distributed, models, parallel
from dtrain.config import Config
from dtrain.data import tokens
from dtrain.distributed.failures import record_failure
from dtrain.errors import EXIT_INTERRUPTED, DtrainError, Preempted, Rank0Missing
from dtrain.models.empty import parameters_on_meta
from dtrain.rundir.mirror import local_dir
from dtrain.train.trainer import Trainer


def run(config: Config) -> dict[str, Any]:
    """Train the job in this process, as one worker of however many the environment says."""
    with distributed.session(
        config.distributed, debug=config.monitor.debug, diagnostics_dir=local_dir(config.run.dir) / "diagnostics"
    ) as session:
        if config.data.download and session.env.local_rank == 0:
            data.fetch(config)
        distributed.barrier()
        splits = data.build(config)
        for note in splits.notes if session.is_main else ():
            print(f"note: {note}", file=sys.stderr, flush=True)
        trainer = build_trainer(config, session, splits)
        if config.data.name == "tokens":
            trainer.setup()  # run.dir taken: keep the tokenizer beside the weights, for `dtrain generate`
            distributed.rank0_decides(lambda: _keep_tokenizer(config), is_main=session.is_main)
        return trainer.fit()


def build_trainer(config: Config, session: distributed.Session, splits: data.DataSplits) -> Trainer:
    """The Trainer of a config-described job: its model built from model.name. Under FSDP from a file's
    weights the model's parameters are built on the meta device: no rank ever holds the whole model, each
    gives memory to its own shards only (parallel/deferred.py) and reads its rows of the file into them."""
    torch.manual_seed(config.run.seed)  # the same initial weights on every rank, run after run
    models.check_kind(config, data.kind_of(config, splits.train))  # also where no launcher checked
    with parameters_on_meta(parallel.builds_on_meta(config, session.world_size)):
        model = models.build(config.model, splits.input_shape, splits.num_classes)
    trainer = Trainer(config, model=model, train_data=splits.train, eval_data=splits.eval)
    trainer.plan.described_by_config = True  # config.toml: [model] and [data] are what trained
    return trainer


def _keep_tokenizer(config: Config) -> None:
    try:
        tokens.keep_tokenizer(config.data.path, local_dir(config.run.dir))
    except (OSError, DtrainError) as exc:
        raise DtrainError(f"could not keep the tokenizer in {config.run.dir}/tokenizer ({exc})") from None


def worker_main(config: Config) -> int:
    """Train `config` as a worker; failures reported as `as_worker` says."""
    return as_worker(lambda: run(config))


def as_worker(work: Callable[[], Any]) -> int:
    """Run `work` as a worker; turn failures into one report (exit 2 for bad input, 1 for a crash).

    Under dtrain's launcher a worker writes its error to torchrun's error file and prints nothing:
    the launcher prints the first failure once. Started by plain torchrun, srun or mpirun, rank 0
    prints a bad-input message and the other ranks stay quiet. One of several workers ends its
    process here (`distributed.end_worker_process`); a single process returns the exit status.
    """
    distributed.die_with_the_launcher()
    env = _env_or_single()
    if env.rank != 0:
        _leave_warnings_to_rank0()
    code = _run_reported(work, env.rank)
    if env.world_size > 1:
        distributed.end_worker_process(code)
    return code


def _leave_warnings_to_rank0() -> None:
    """Libraries warn once per process (a deprecation, a default they fell back to, transformers' notes
    on a model): every rank would repeat rank 0's words, interleaved with its console. Ranks other
    than 0 keep their errors and drop the warnings of Python's `warnings`, of loggers nobody configured
    (the root's default level) and of Hugging Face's libraries; a user's own choice (-W,
    PYTHONWARNINGS, TRANSFORMERS_VERBOSITY, a configured root logger) stands."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if not sys.warnoptions:
        warnings.simplefilter("ignore")
    root = logging.getLogger()
    if not root.handlers and root.level == logging.WARNING:  # nobody configured logging yet
        root.setLevel(logging.ERROR)


def _run_reported(work: Callable[[], Any], rank: int) -> int:
    try:
        work()
        return 0
    except SystemExit as exc:  # a launched script's own sys.exit(...)
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr, flush=True)
        return 1
    except Preempted as exc:
        if rank == 0:
            print(f"dtrain: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except KeyboardInterrupt:  # Ctrl-C outside training (there the Trainer stops with a checkpoint)
        if rank == 0:
            print("dtrain: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except DtrainError as exc:
        alone = isinstance(exc, Rank0Missing)  # no rank 0 is there to say it
        record_failure(str(exc), rank, traceback_text=None, alone=alone)
        if rank != 0 and not alone and not os.environ.get(distributed.LAUNCHED_BY_DTRAIN):
            # Only rank 0 prints: under plain torchrun the first rank to exit gets the others stopped,
            # and rank 0, reaching the same error a moment later, would be stopped before saying it.
            time.sleep(2.0)
        return exc.exit_code  # 2 for bad input; 73 for a run.dir another run took over (RunDirLost)
    except Exception as exc:
        record_failure(f"{type(exc).__name__}: {exc}", rank, traceback_text=traceback.format_exc())
        return 1


def _env_or_single() -> distributed.DistEnv:
    try:
        return distributed.detect_env()
    except DtrainError:  # an impossible environment: the worker's own start reports it
        return distributed.DistEnv()
