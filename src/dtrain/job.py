"""A job described by a config, from the launcher's checks to each worker's run."""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import checkpoint, data, devices, distributed, models, parallel, rundir
from .amp import precision_problem
from .checkpoint import RunDirLock
from .comm import check_comm_hook
from .config import Config
from .data import tokens
from .errors import EXIT_USAGE, ConfigError, DtrainError, Preempted
from .failures import report
from .trackers import check_installed
from .trainer import Trainer, check_shardable


def preflight(config: Config, world_size: int, local_world_size: int, config_file: str | None = None) -> None:
    """Refuse, before any process starts, a job that cannot run here; fetch data it may download."""
    run_dir = Path(config.run.dir)
    rundir.check_config_file_is_ours(run_dir, Path(config_file) if config_file else None)
    rundir.check_usable(run_dir)
    check_installed([t for t in config.monitor.trackers if t != "tensorboard"])
    backend = distributed.resolve_backend(config.distributed.backend)
    check_comm_hook(config.distributed.comm_hook, backend)
    problem = parallel.check_sharding(config, world_size, local_world_size)
    if problem:
        raise ConfigError(problem)
    gpus = devices.visible_gpus()
    distributed.check_device_capacity(backend, local_world_size, len(gpus))
    # The devices the workers will bind: the first GPUs, or this CPU.
    targets = [("cuda", g.name, g.capability) for g in gpus[:local_world_size]] or [("cpu", "", (0, 0))]
    for device_type, name, capability in targets:
        problem = precision_problem(
            config.training.precision, device_type, name, capability, rocm=torch.version.hip is not None
        )
        if problem:
            raise ConfigError(problem)
    if config.training.compile != "none":
        problem = parallel.blocks.compiler_problem(targets[0][0])
        if problem:
            raise ConfigError(problem)
    data.prepare(config)
    data.check(config, world_size)
    n_train = data.size_hint(config)
    if n_train is not None:
        check_shardable(config, n_train, world_size)
    rundir.check_contents(run_dir, config.run.allow_other_files)
    fresh = config.run.overwrite and not rundir.later_attempt()  # a restart of this run resumes instead
    # Token data is served in an order that does not depend on the world size; a factory's may be.
    global_order = True if config.data.name == "tokens" else (None if ":" in config.data.name else False)
    resume_from = checkpoint.preflight(config, run_dir, world_size, global_order, fresh=fresh)
    if world_size > local_world_size:
        return  # several nodes, maybe one shared run.dir: rank 0 judges it, wherever it runs (Trainer)
    RunDirLock(run_dir).check_free()
    # Refused now if it must be; deleted (run.overwrite) only by rank 0 once the run has started.
    rundir.earlier_outputs(run_dir, resuming=resume_from is not None, overwrite=fresh, again=rundir.later_attempt())


def run(config: Config) -> dict[str, Any]:
    """Train the job in this process, as one worker of however many the environment says."""
    with distributed.session(
        config.distributed, debug=config.monitor.debug, diagnostics_dir=Path(config.run.dir) / "diagnostics"
    ) as session:
        if config.data.download and session.env.local_rank == 0:
            data.prepare(config)
        distributed.barrier()
        splits = data.build(config)
        torch.manual_seed(config.run.seed)  # the same initial weights on every rank, run after run
        model = models.build(config.model, splits.input_shape, splits.num_classes)
        trainer = Trainer(config, model=model, train_data=splits.train, eval_data=splits.eval)
        if config.data.name == "tokens":
            trainer.setup()  # run.dir taken: keep the tokenizer beside the weights, for `dtrain generate`
            error = None
            if session.is_main:
                try:
                    tokens.keep_tokenizer(config.data.path, Path(config.run.dir))
                except (OSError, DtrainError) as exc:
                    error = f"could not keep the tokenizer in {config.run.dir}/tokenizer ({exc})"
            error = distributed.first_error(error)
            if error:
                raise DtrainError(error)
        return trainer.fit()


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
    code = _run_reported(work, env.rank)
    if env.world_size > 1:
        distributed.end_worker_process(code)
    return code


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
    except KeyboardInterrupt:  # Ctrl-C reaches every worker: the launcher says it once
        return 128 + signal.SIGINT
    except DtrainError as exc:
        report(str(exc), rank, traceback_text=None)
        if rank != 0 and not os.environ.get(distributed.LAUNCHED_BY_DTRAIN):
            # Only rank 0 prints: under plain torchrun the first rank to exit gets the others stopped,
            # and rank 0, reaching the same error a moment later, would be stopped before saying it.
            time.sleep(2.0)
        return EXIT_USAGE
    except Exception as exc:
        report(f"{type(exc).__name__}: {exc}", rank, traceback_text=traceback.format_exc())
        return 1


def _env_or_single() -> distributed.DistEnv:
    try:
        return distributed.detect_env()
    except DtrainError:  # an impossible environment: the worker's own start reports it
        return distributed.DistEnv()
