"""The launcher's checks before any worker starts: a job that cannot run here is refused at once, in one
line, with nothing written; data it may download is fetched."""

from __future__ import annotations

import functools
import sys
from collections.abc import Collection
from pathlib import Path

import torch

from dtrain import data, distributed, models, objstore, parallel, rundir
from dtrain.checkpoint import init_from
from dtrain.config import Config, check_model_fits_data, with_global_batch
from dtrain.errors import ConfigError, DtrainError
from dtrain.launch import gpus as devices
from dtrain.observe.tracker_servers import check_servers
from dtrain.observe.trackers import check_installed
from dtrain.parallel.ddp_comm import check_comm_hook
from dtrain.parallel.dims import TpProblem
from dtrain.rundir import resume_point
from dtrain.rundir.lock import RunDirLock
from dtrain.rundir.mirror import fetch_for_launcher
from dtrain.train.amp import precision_problem
from dtrain.train.speed import cpu_bf16_note


def preflight(config: Config, world_size: int, local_world_size: int, config_file: str | None = None) -> str | None:
    """Refuse, before any process starts, a job that cannot run here; fetch data it may download. A line to
    say instead of starting any (a finished run rerun: nothing to train), or None."""
    check_model_fits_data(config)
    # The processes drawing distinct samples: the world, less a replica's tensor and pipeline peers.
    dp = parallel.data_ranks(config, world_size, local_world_size)
    config = with_global_batch(config, dp)  # the largest world of an elastic range; workers redo it
    run_dir = Path(config.run.dir)
    if objstore.is_url(config.run.dir):  # the store checked, and its run.dir fetched to a staging folder
        run_dir = fetch_for_launcher(config.run.dir, config.checkpoint.keep)
    rundir.check_config_file_is_ours(run_dir, Path(config_file) if config_file else None)
    rundir.check_usable(run_dir)
    trackers = [t for t in config.monitor.trackers if t != "tensorboard"]
    check_installed(trackers)
    check_servers(trackers)  # within seconds, where the trackers' own clients would wait for minutes
    backend = distributed.resolve_backend(config.distributed.backend, config.training.device)
    check_comm_hook(config.ddp.comm_hook, backend)
    gpus = devices.visible_gpus()
    device_type = "cuda" if gpus and config.training.device != "cpu" else "cpu"
    problem = parallel.check_sharding(config, world_size, local_world_size, device_type, _model_tp_problem(config))
    if problem:
        raise ConfigError(problem)
    devices.check_device_capacity(backend, local_world_size, len(gpus))
    # The devices the workers will bind: the first GPUs, or this CPU.
    targets = [("cuda", g.name, g.capability) for g in gpus[:local_world_size]] or [("cpu", "", (0, 0))]
    for device_type, name, capability in targets:
        problem = precision_problem(
            config.training.precision, device_type, name, capability, rocm=torch.version.hip is not None
        )
        if problem:
            raise ConfigError(problem)
    if config.training.precision == "bf16" and targets[0][0] == "cpu":  # said once, by the launcher
        note = cpu_bf16_note(max(1, distributed.available_cores() // local_world_size))
        if note:
            print(f"note: {note}", file=sys.stderr, flush=True)
    strategy = config.parallel.strategy
    if strategy == "fsdp" and dp == 1 and world_size > 1:  # tensor/pipeline peers hold the whole world
        print(
            f"note: parallel.strategy = {strategy} shards over the data-parallel processes and this job has "
            f"one ({world_size} processes, each a tensor or pipeline part of one replica): it shards nothing",
            file=sys.stderr,
            flush=True,
        )
    if config.training.compile != "none":
        problem = parallel.blocks.compiler_problem(targets[0][0])
        if problem:
            raise ConfigError(problem)
    models.check_folder(config.model)
    weights = init_from.resolve(*config.model.weights) if config.model.weights else None  # readable, or refused
    data.fetch(config)
    data.check(config, dp)
    sample = data.sample_of(config)
    if sample is not None:  # a built-in data set: whether the model can be built for it is known now
        model = models.check(config.model, *sample)  # on the meta device: how the sizes split it, checked now
        if model is not None and weights is not None:  # names and shapes, from the files' headers
            init_from.check_fit(model, weights)
        problem = parallel.model_problem(config, model, world=(world_size, local_world_size)) if model else None
        if problem:  # e.g. tensor parallel over more processes than the model has heads
            raise ConfigError(problem)
    n_train = data.size_hint(config)
    if n_train is not None:
        data.check_shardable(config, n_train, dp)
    # Token data is served in an order that does not depend on the world size; a factory's may be.
    global_order = data.global_order_of(config)
    # On one node only: on several, a node's launcher leaving at once would keep the others waiting. Before
    # run.dir's contents are judged: a finished run is complete whatever was put beside it since (.DS_Store).
    if world_size == local_world_size:
        done = resume_point.finished(config, run_dir, dp, n_train, global_order)
        if done:
            return done
    rundir.check_contents(run_dir, config.run.allow_other_files)
    fresh = config.run.overwrite and not distributed.later_attempt()  # a restart of this run resumes instead
    resume_from = resume_point.preflight(config, run_dir, dp, global_order, fresh=fresh)
    if world_size > local_world_size:
        return None  # several nodes, maybe one shared run.dir: rank 0 judges it, wherever it runs (Trainer)
    RunDirLock(run_dir).check_free()
    # Refused now if it must be; deleted (run.overwrite) only by rank 0 once the run has started.
    rundir.earlier_outputs(
        run_dir, resuming=resume_from is not None, overwrite=fresh, again=distributed.later_attempt()
    )
    return None


def _model_tp_problem(config: Config) -> TpProblem:
    """Why the job's built-in model cannot be split over that many tensor-parallel processes; asked only by
    a refusal of the sizes, to give the model's reason and offer sizes that would work. The model is built
    then, on the meta device; one that cannot be built yet has no reason (its own check says why, later)."""

    @functools.cache
    def model() -> torch.nn.Module | None:
        try:
            sample = data.sample_of(config)
            return models.check(config.model, *sample) if sample is not None else None
        except DtrainError:
            return None

    def problem(tp: int, sizes: Collection[int] | None) -> str | None:
        built = model()
        return parallel.tp_problem(config, built, tp, sizes) if built is not None else None

    return problem
