"""The training loop: the model spread by a strategy (DDP, FSDP), sharded batches, accumulation without
sync, autocast, clipping, exact eval.

    trainer = dtrain.Trainer(config, model=net, train_data=train_set, eval_data=test_set)
    trainer.fit()

`Trainer.fit` runs in every process. Read `_train_step` top to bottom: it is the whole step.
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from dtrain import data, distributed, parallel, rundir
from dtrain.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointStore,
    Parts,
    Position,
    resume_geometry,
    truncate_metrics,
)
from dtrain.checkpoint.export import save_final_weights
from dtrain.checkpoint.state import processes, regroup
from dtrain.config import Config, profile_range
from dtrain.data import EvalBatches, ShardSampler, TensorDict, TrainBatches
from dtrain.data.batch import num_samples, num_tokens, split
from dtrain.data.sampler import GlobalOrderSampler
from dtrain.errors import DataError, DtrainError, Preempted
from dtrain.files import atomic_write_text
from dtrain.observe import memory, perf
from dtrain.observe.metrics import StepMetrics
from dtrain.observe.monitor import Monitor
from dtrain.observe.profiling import StepProfiler
from dtrain.observe.steptime import StepTimer
from dtrain.observe.watchdog import HangWatch
from dtrain.rundir.lock import RunDirLock
from dtrain.train.amp import precision_for
from dtrain.train.evaluation import EvalMetrics, EvalSums
from dtrain.train.loss import LossFn, LossOf, StepFn
from dtrain.train.optim import LRShape, build_optimizer, build_scheduler
from dtrain.train.stopping import StopRequest


class Trainer:
    """Trains `model` data-parallel over every process of the job.

    `train_data` / `eval_data` are map-style data sets whose samples may be any shape: tensors, tuples,
    dicts (Hugging Face's included), namedtuples, dataclasses, nested; collated by `collate_fn` (default:
    `default_collate`, dataclasses too). A `TensorDataset` of any number of tensors, or a dict of equally
    long tensors, takes the fast path (whole batches gathered by index). The loss: `step_fn(model,
    batch)`; else a dict batch's `model(**batch).loss` (or `loss_fn(output, batch)`); else
    `loss_fn(model(inputs), target)` for an `(inputs, target)` batch (default: cross-entropy) — see
    loss.py. `eval_metrics(output, batch)` returns more per-batch means to report, averaged over every
    eval sample exactly. After `setup()`, `strategy` is the strategy spreading the model over the
    processes (`distributed.strategy`), `model` what the step calls (DDP's wrapper; under FSDP the
    sharded module itself; the plain module at world size 1), `module` the user's own.
    """

    def __init__(
        self,
        config: Config | None = None,
        *,
        model: nn.Module,
        train_data: Dataset | Mapping[str, torch.Tensor],
        eval_data: Dataset | Mapping[str, torch.Tensor] | None = None,
        loss_fn: LossFn | None = None,
        step_fn: StepFn | None = None,
        eval_metrics: EvalMetrics | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ):
        self.config = config or Config()
        self.module = model
        self.train_data = TensorDict(train_data) if isinstance(train_data, Mapping) else train_data
        self.eval_data = TensorDict(eval_data) if isinstance(eval_data, Mapping) else eval_data
        self.loss_of = LossOf(step_fn, loss_fn)
        self.eval_metrics = eval_metrics
        self.collate_fn = collate_fn
        self.session: distributed.Session | None = None
        self.model: nn.Module = model
        self.strategy: parallel.Strategy | None = None
        self.step = 0  # optimizer steps taken
        self.epoch = 0
        self.run_dir = Path(self.config.run.dir)
        # More state the checkpoints carry beside the model, optimizer and schedule: see
        # register_for_checkpointing.
        self.checkpoint_parts: dict[str, Any] = {}

    @property
    def parallel(self) -> parallel.Strategy | None:
        """The strategy, by its name before 0.2 (`strategy` now, as in Lightning Fabric)."""
        return self.strategy

    def register_for_checkpointing(self, **parts: Any) -> None:
        """Checkpoint these objects with the run and restore them on resume, by name:
        `trainer.register_for_checkpointing(ema=ema)`. Each has `state_dict()` and `load_state_dict()`
        (torch's Stateful protocol), as Accelerate's `register_for_checkpointing` asks. Call it before
        `setup()` or `fit()`: resuming happens in set-up."""
        if self.session is not None:
            raise DtrainError(
                "register_for_checkpointing() after setup(): the run has resumed already; register "
                "before setup() or fit()"
            )
        for name, part in parts.items():
            if not (callable(getattr(part, "state_dict", None)) and callable(getattr(part, "load_state_dict", None))):
                raise DtrainError(
                    f"register_for_checkpointing({name}=...) needs an object with state_dict() and "
                    f"load_state_dict(); {type(part).__name__} has not both"
                )
        self.checkpoint_parts.update(parts)

    # --- set-up ---------------------------------------------------------------------------------

    def setup(self) -> None:
        """Join the process group, wrap the model, build optimizer, schedule, batches and monitor.

        Everything that can refuse the job (precision, data sizes) is checked before anything is
        written to `run.dir`. Called by `fit()`; call it yourself to reach `self.model` first.
        """
        if self.session is not None:
            return
        self.session = distributed.start(
            self.config.distributed, debug=self.config.monitor.debug, diagnostics_dir=self.run_dir / "diagnostics"
        )
        self._lock = RunDirLock(self.run_dir)
        self._fresh = False
        try:
            self._build()
        except BaseException as exc:
            self._forget_a_run_that_trained_nothing()
            self._lock.release(remove_if_created=True)
            distributed.stop(self.session)
            if _out_of_memory(exc):
                raise self._out_of_memory("while setting up (model, data held on the device)", exc) from None
            raise

    def _build(self) -> None:
        cfg, session = self.config, self.session
        device = session.device
        if not isinstance(self.module, nn.Module) or not any(p.requires_grad for p in self.module.parameters()):
            what = type(self.module).__name__
            raise DtrainError(
                f"the model ({what}) has no trainable parameters: there is nothing to train; "
                f"give a torch.nn.Module with parameters that require gradients"
            )
        self.precision = precision_for(cfg.training.precision, device, cfg.training.tf32)
        data.check_shardable(cfg, len(self.train_data), session.world_size)
        self._regrouped = self._regroup()

        sampler = self._sampler()
        self.train_batches = TrainBatches(
            self.train_data, sampler, cfg.data, cfg.training.grad_accum_steps, device, self.collate_fn
        )
        self.eval_batches = (
            EvalBatches(self.eval_data, session.rank, session.world_size, cfg.data, device, self.collate_fn)
            if self.eval_data is not None
            else None
        )
        if self.train_batches.steps_per_epoch == 0:
            raise DataError(
                f"data.drop_last=true with data.batch_size={cfg.data.batch_size} leaves no "
                f"full batch of the {sampler.num_samples} samples per process; lower "
                f"data.batch_size or set data.drop_last=false"
            )

        self.module.to(device)
        peak = perf.peak_flops(device, cfg.training.precision, cfg.monitor.peak_tflops, cfg.training.tf32)
        count = cfg.monitor.flops == "yes" or (cfg.monitor.flops == "auto" and peak is not None)
        flops_per_sample = self._count_flops() if count else None  # on the whole module, before sharding
        self.timer = StepTimer(device, enabled=cfg.monitor.breakdown)
        self.strategy = parallel.build(cfg, session, self.module, self.timer)
        self.model = self.strategy.model
        self.optimizer = build_optimizer(cfg.optimizer, self.module.parameters(), device)
        self.total_steps = self._planned_steps()
        self.scheduler = build_scheduler(cfg.scheduler, self.optimizer, self.total_steps)
        self.metrics = StepMetrics(
            device,
            session.world_size,
            self.timer,
            hosts=distributed.hostnames(),
            flops_per_sample=flops_per_sample,
            peak_flops=peak,
            straggler_margin=cfg.monitor.straggler_margin,
            count_skips=self.precision.scaler.is_enabled(),
        )
        self.profiler = StepProfiler(
            profile_range(cfg.profile.steps) if cfg.profile.steps else None,
            self.run_dir,
            session.rank,
            device.type == "cuda",
        )
        self._first_backward_checked = False

        self._take_run_dir()
        self.checkpointer = Checkpointer(
            cfg.checkpoint,
            self.run_dir,
            Parts(
                self.module,
                self.optimizer,
                self.scheduler,
                self.precision.scaler,
                session.rank,
                session.world_size,
                cfg.data.batch_size * cfg.training.grad_accum_steps,
                identity={
                    "optimizer.name": cfg.optimizer.name,
                    "run.seed": cfg.run.seed,
                    "data.name": cfg.data.name,
                    "training samples": len(self.train_data),
                },
                extra=self.checkpoint_parts,
                setup={
                    "distributed.strategy": cfg.distributed.strategy,
                    "training.compile": cfg.training.compile,
                    "training.activation_checkpointing": cfg.training.activation_checkpointing,
                    "training.precision": cfg.training.precision,
                },
            ),
        )
        resume_from = self.checkpointer.find_resume_point()
        self._fresh = resume_from is None  # what run.dir holds from here on is this run's own
        replanned = rescheduled = None
        if resume_from is not None:
            if resume_from.step > self.total_steps:
                raise DtrainError(
                    f"{resume_from.path} is at step {resume_from.step} and this config plans "
                    f"{self.total_steps} steps (training.epochs={cfg.training.epochs}, "
                    f"training.max_steps={cfg.training.max_steps}); raise them to continue "
                    f"that run, or start a new run.dir"
                )
            wanted = _hyperparameters(self.optimizer)  # the config's, before the checkpoint's replace them
            position = self.checkpointer.restore(resume_from)
            self.step, self.epoch = position.step, position.epoch
            self.metrics.skipped_sum.fill_(position.unscheduled_skips)
            respread = ", ".join(
                f"{key} {position.setup[key]} → {value}"
                for key, value in self.checkpointer.parts.setup.items()
                if key in position.setup and position.setup[key] != value
            )
            rescheduled = self._follow_the_configs_plan()
            replanned = ", ".join(filter(None, (rescheduled, self._follow_the_configs_optimizer(wanted), respread)))
        self._lr = self.optimizer.param_groups[0]["lr"]

        continuing = resume_from is not None and self.step < self.total_steps
        if session.is_main:
            atomic_write_text(self.run_dir / "config.toml", rundir.CONFIG_HEADER + cfg.to_toml())
            if continuing:
                # An epoch that ended exactly at the checkpoint is evaluated again on resume.
                epoch_end_pending = self.step == (self.epoch + 1) * self.train_batches.steps_per_epoch
                truncate_metrics(self.run_dir / "metrics.jsonl", self.step, drop_eval_at_step=epoch_end_pending)
        self.monitor = Monitor(
            self.run_dir,
            session.is_main,
            self.total_steps,
            self.step,
            purge_after=self.step if continuing else None,
            trackers=cfg.monitor.trackers,
            config=cfg.to_dict(),
        )
        if self._replaced:
            whose = (
                "an earlier attempt of this run" if distributed.later_attempt() else "the earlier run (run.overwrite)"
            )
            self.monitor.info(f"replaced the outputs of {whose}: {', '.join(self._replaced)}")
        attempt = distributed.describe_attempt(session.world_size)
        if attempt:
            self.monitor.info(attempt)
        if resume_from is not None:
            self.monitor.info(
                f"resumed from {resume_from.path} (step {self.step} of {self.total_steps}, "
                f"epoch {self.epoch})" + ("" if continuing else ": the run is already complete")
            )
        if self._regrouped and continuing:
            self.monitor.info(self._regrouped)
        if replanned and continuing:
            self.monitor.info(
                f"the config changed since that checkpoint ({replanned}): this run follows it from "
                f"step {self.step}" + (", the learning-rate schedule rebuilt for its plan" if rescheduled else "")
            )
        self.timer.progress.step = self.step
        self.watch = HangWatch(
            self.timer.progress, cfg.distributed.hang_timeout_s, session.rank, session.world_size, self.run_dir
        )

    def _regroup(self) -> str | None:
        """Resuming a checkpoint written by another number of processes (a node lost for good, a job
        requeued on another allocation), or with another data.batch_size: the same global sample position
        and global batches, `training.grad_accum_steps` changed to make them up (see
        checkpoint.state.regroup); on another number of processes only token data can, other data is
        refused. What changed, for the console, or None."""
        cfg, answer = self.config, (None, None)
        if self.session.is_main:
            try:
                saved = resume_geometry(
                    cfg.checkpoint, self.run_dir, fresh=cfg.run.overwrite and not distributed.later_attempt()
                )
                if saved is not None and saved[2]:
                    accum = regroup(
                        *saved,
                        self.session.world_size,
                        cfg.data.batch_size,
                        cfg.training.grad_accum_steps,
                        getattr(self.train_data, "global_order", False),
                    )
                    answer = ((saved[0], saved[1], accum), None)
            except DtrainError as exc:
                answer = (None, str(exc))
        found, error = distributed.from_rank0(answer)
        if error:
            raise DtrainError(error)
        if found is None or found[2] == cfg.training.grad_accum_steps:
            return None
        name, saved_world, accum = found
        before, cfg.training.grad_accum_steps = cfg.training.grad_accum_steps, accum
        world, global_batch = self.session.world_size, accum * cfg.data.batch_size * self.session.world_size
        if saved_world == world:  # another data.batch_size, or a checkpoint of a regrouped run
            return (
                f"{name} took global batches of {global_batch} samples: with data.batch_size="
                f"{cfg.data.batch_size} on {processes(world)}, training.grad_accum_steps {accum} (not the "
                f"config's {before}) keeps them"
            )
        return (
            f"{name} was written by {processes(saved_world)} and this run has {world}: "
            f"training.grad_accum_steps {before} → {accum} keeps its global batch of {global_batch} samples"
        )

    def _sampler(self) -> ShardSampler:
        """DistributedSampler's order; for data that asks for it (token windows) an order that does not
        depend on the world size, which needs one whole global batch."""
        n, session, cfg = len(self.train_data), self.session, self.config
        if not getattr(self.train_data, "global_order", False):
            return ShardSampler(n, session.rank, session.world_size, seed=cfg.run.seed)
        sampler = GlobalOrderSampler(
            n,
            session.rank,
            session.world_size,
            cfg.data.batch_size,
            seed=cfg.run.seed,
            accum=cfg.training.grad_accum_steps,
        )
        if sampler.global_batches == 0:
            raise DataError(
                f"the training set has {n} samples, fewer than one global batch "
                f"(data.batch_size={cfg.data.batch_size} × {session.world_size} processes); lower "
                f"data.batch_size (or data.block_size for token data)"
            )
        return sampler

    def _count_flops(self) -> float | None:
        """Training FLOPs per sample: from the model's own count per token where it has one (the built-in
        GPT: 6N + attention, as nanoGPT and PaLM count), else counted once on a meta-device copy of one
        micro-batch."""
        micro = next(iter(self.train_batches.epoch(0)))[0]
        samples, target = num_samples(micro), split(micro)[1]
        per_token, tokens = getattr(self.module, "flops_per_token", None), num_tokens(target)
        if callable(per_token) and tokens:
            return per_token(target.shape[-1]) * tokens / samples
        return perf.flops_per_sample(self.module, micro, samples, self.loss_of)

    def _take_run_dir(self) -> None:
        """Rank 0 checks run.dir (usable; no other program's files; an earlier run only when told to
        replace it), locks it for the life of the run (two live runs must never share it), checks the
        final weights will fit, and only then deletes an earlier run's outputs (see rundir)."""
        error, self._replaced = None, []
        if self.session.is_main:
            try:
                run, again = self.config.run, distributed.later_attempt()
                rundir.check_usable(self.run_dir)
                rundir.check_config_file_is_ours(self.run_dir)
                rundir.check_contents(self.run_dir, run.allow_other_files)
                fresh = run.overwrite and not again  # a restart of this run resumes instead
                resuming = not fresh and CheckpointStore(self.run_dir).newest() is not None
                earlier = rundir.earlier_outputs(self.run_dir, resuming=resuming, overwrite=fresh, again=again)
                self._lock.acquire()
                rundir.check_room(self.run_dir, _weights_bytes(self.module), "the final model.safetensors")
                rundir.remove(earlier)
                self._replaced = [p.name for p in earlier]
            except DtrainError as exc:
                error = str(exc)
        error = distributed.first_error(error)
        if error:
            raise DtrainError(error)

    def _forget_a_run_that_trained_nothing(self) -> None:
        """A new run that fails before its first step (bad data found in the first batch, a model that
        does not fit) leaves nothing half-written: rank 0 removes what it wrote to run.dir, so the
        rerun with the problem fixed starts as the first would."""
        if not (self._fresh and self.step == 0 and self.session.is_main):
            return
        if getattr(self, "monitor", None) is not None:
            self.monitor.close()
        rundir.remove(
            [self.run_dir / name for name in rundir.OUTPUTS if name != "checkpoints" and (self.run_dir / name).exists()]
        )

    def _planned_steps(self) -> int:
        steps = self.config.training.epochs * self.train_batches.steps_per_epoch
        max_steps = self.config.training.max_steps
        return min(steps, max_steps) if max_steps else steps

    # --- the loop -------------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        """Train for `training.epochs` (or `training.max_steps`); returns the last logged metrics.

        Raises `Preempted` after writing a checkpoint when the job receives SIGTERM.
        """
        self.setup()
        last: dict[str, Any] = {}
        together = False  # whether every rank leaves this loop in step
        compiling = self.config.training.compile != "none"  # torch.compile compiles on the first call
        stop = StopRequest()
        stop.install()
        self.watch.start()
        distributed.barrier()  # rank 0's extra set-up (TensorBoard, files) must not count as others' waiting
        self.metrics.restart()
        try:
            self.model.train()
            batches = self._batch_stream()
            first_step = self.step
            if self.step < self.total_steps:
                last = self._end_epoch_if_done(last)  # resumed where an epoch ended: its evaluation first
            self._stop_check_every = self.config.training.log_every
            while self.step < self.total_steps and not self._stop_step_reached():
                self.profiler.before_step(self.step + 1)
                began = time.perf_counter()
                self.timer.start()
                micro_batches = next(batches)
                self.timer.data_ready()
                if compiling:
                    compiling = False
                    self._compiling_step(micro_batches)
                else:
                    self._train_step(micro_batches)
                self.step += 1
                self.monitor.advance()
                if self.step == first_step + 2:  # the first step compiles and warms up: the second is typical
                    self._pace_stop_checks(time.perf_counter() - began)
                last, stopping = self._log_if_due(last, stop)
                if self.checkpointer.due(
                    self.step, last=self.step == self.total_steps, forced=stopping or self._stop_step_reached()
                ):
                    self._save_checkpoint()
                if stopping:
                    together = True
                    raise Preempted(
                        f"stopped by SIGTERM at step {self.step}; checkpoint written to "
                        f"{self.checkpointer.store.root}/step-{self.step}; rerun the same command to "
                        f"resume"
                    )
                if self.step < self.total_steps and self._stop_step_reached():
                    break
                last = self._end_epoch_if_done(last)
            if self.step < self.total_steps:  # at training.stop_at_step
                self.monitor.info(
                    f"stopped at step {self.step} as training.stop_at_step asks; resume to continue"
                    if self.step > first_step
                    else f"training.stop_at_step={self.config.training.stop_at_step} and the run is at step "
                    f"{self.step} already: nothing trained; rerun without it (or with a later step) to continue"
                )
                distributed.barrier()
                together = True
                return last
            self._write_final_weights()
            distributed.barrier()
            together = True
        except (torch.cuda.OutOfMemoryError, MemoryError, RuntimeError) as exc:
            if not _out_of_memory(exc):
                raise
            raise self._out_of_memory(f"at step {self.step + 1}", exc) from None
        finally:
            self.watch.stop()
            self.profiler.close()
            stop.uninstall()
            self.monitor.close()
            if not together:
                self._forget_a_run_that_trained_nothing()
            self._lock.release()
            distributed.stop(self.session, together)
        return last

    def _stop_step_reached(self) -> bool:
        """Whether the run has reached `training.stop_at_step` — or its end, where that lies beyond it (a
        checkpoint is written there too, so the command without it continues or finds the run complete)."""
        stop_at = self.config.training.stop_at_step
        return stop_at > 0 and self.step >= min(stop_at, self.total_steps)

    def _batch_stream(self) -> Iterator[list[Any]]:
        """Every step's micro-batches from this run's position on, one epoch's order after the next
        (each epoch shuffled by its number, so a resumed run sees the batches it would have)."""
        per_epoch = self.train_batches.steps_per_epoch
        for epoch in itertools.count(self.step // per_epoch):
            yield from self.train_batches.epoch(epoch, start_step=max(0, self.step - epoch * per_epoch))

    def _log_if_due(self, last: dict[str, Any], stop: StopRequest) -> tuple[dict[str, Any], bool]:
        """The step's record at `training.log_every` steps and the last, and whether the group stops
        (SIGTERM) before its planned end: the log step's gather carries every rank's stop request, so
        all agree; a lone process has nobody to agree with and checks every step."""
        stopping = False
        if self.step % self.config.training.log_every == 0 or self.step == self.total_steps:
            last, stopping = self._log_train(stop.requested)
        elif self.session.world_size == 1:
            stopping = stop.requested
        elif self.step % self._stop_check_every == 0:  # slow steps: see _pace_stop_checks
            stopping = any(distributed.gather_objects(stop.requested))
        return last, stopping and self.step < self.total_steps

    def _pace_stop_checks(self, seconds: float) -> None:
        """After SIGTERM the ranks must agree to stop, and write the checkpoint, within
        `checkpoint.preempt_grace_s`. They agree at log steps; where `training.log_every` steps of this
        run's pace (the slowest rank's second step, agreed once: a collective) would take more than a
        quarter of that grace, they also agree every so many steps between — one tiny gather per that
        many slow steps. Fast steps keep log steps as the only agreement."""
        log_every = self.config.training.log_every
        if self.session.world_size == 1 or log_every == 1:
            return
        slowest = max(distributed.gather_objects(seconds))
        affordable = int(self.config.checkpoint.preempt_grace_s / 4 / max(slowest, 1e-6))
        self._stop_check_every = max(1, min(log_every, affordable))

    def _end_epoch_if_done(self, last: dict[str, Any]) -> dict[str, Any]:
        """At the end of an epoch, count it and evaluate when `training.eval_every` asks (and after the
        last step in any case)."""
        epoch_done = self.step == (self.epoch + 1) * self.train_batches.steps_per_epoch
        if epoch_done:
            self.epoch += 1
        if self._should_evaluate(epoch_done):
            last = {**last, **self._log_eval()}
        return last

    def _write_final_weights(self) -> None:
        """model.safetensors: the end of the run, its most valuable moment. If the weights cannot be
        written (a full disk, a directory in the way), the trained state is kept in a checkpoint and
        the run says where, exit 2 — never a finished run with nothing to show."""
        path = self.run_dir / "model.safetensors"
        error = None
        self._refuse_a_diverged_state()
        state = self.strategy.full_state_dict()  # a collective under FSDP
        if self.session.is_main:
            try:
                save_final_weights(state, path)
            except Exception as exc:
                error = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).strip()
                if "No space left on device" in error:  # safetensors wraps it: "I/O error: ... (os error 28)"
                    error = "No space left on device"
        error = distributed.first_error(error)
        if error is None:
            return
        if self.checkpointer.last_saved_step != self.step:
            try:
                self._save_checkpoint()
            except CheckpointError as exc:
                # run.dir's disk is full: the last resort is the system's temporary folder (often another disk).
                rescued = distributed.from_rank0(_rescue_weights(state) if self.session.is_main else None)
                kept = (
                    f"the trained weights are safe in {rescued}: copy them to {path} once there is room"
                    if rescued
                    else "and no copy of the weights could be written anywhere else either"
                )
                raise DtrainError(
                    f"could not write {path} ({error}), nor a checkpoint of the trained state ({exc}); {kept}"
                ) from None
        raise DtrainError(
            f"could not write {path} ({error}); the trained state is safe in "
            f"{self.checkpointer.store.root}/step-{self.step}: make room (or move what is in "
            f"the way) and rerun the same command to write the weights"
        )

    def _save_checkpoint(self) -> None:
        self.metrics.pause()
        self.timer.progress.at("checkpoint")
        self._refuse_a_diverged_state()  # a rerun would resume into it
        position = Position(self.step, self.epoch, unscheduled_skips=int(self.metrics.skipped_sum.item()))
        checkpoint = self.checkpointer.save(position)
        self.metrics.resume()
        self.monitor.info(f"checkpoint {checkpoint.name} written")

    def _out_of_memory(self, when: str, exc: BaseException) -> DtrainError:
        cfg = self.config
        batch, accum = cfg.data.batch_size, cfg.training.grad_accum_steps
        levers = [
            f"data.batch_size={max(1, batch // 2)} training.grad_accum_steps={accum * 2} (the same effective batch)"
            if batch > 1
            else "a smaller model"
        ]
        if cfg.training.precision == "fp32":
            levers.append("training.precision=bf16")
        if cfg.data.on_device and self.session.device.type == "cuda":
            levers.append("data.on_device=false")
        sharded = self.strategy.shards_state if self.strategy is not None else parallel.shards_state(cfg)
        if not sharded and self.session.world_size > 1:
            levers.append("distributed.strategy=fsdp (parameters, gradients and optimizer state sharded)")
        if cfg.training.activation_checkpointing == "none" and _has_blocks(self.module, cfg):
            levers.append("training.activation_checkpointing=full")
        if sharded and not cfg.distributed.fsdp_cpu_offload and self.session.device.type == "cuda":
            levers.append("distributed.fsdp_cpu_offload=true")
        what = "GPU memory" if isinstance(exc, torch.cuda.OutOfMemoryError) else "memory"
        return DtrainError(
            f"out of {what} {when} on rank {self.session.rank} with "
            f"data.batch_size={batch} per process (training.grad_accum_steps={accum}, "
            f"training.precision={cfg.training.precision}); try {' or '.join(levers)}"
        )

    def _compiling_step(self, micro_batches: list[Any]) -> None:
        """The step in which torch.compile compiles: timed on its own console line, left out of the
        step-time breakdown and of samples/s and tokens/s."""
        self.metrics.pause()
        timing, self.timer.enabled = self.timer.enabled, False
        began = time.perf_counter()
        try:
            self._train_step(micro_batches)
        except Exception as exc:
            if not type(exc).__module__.startswith(("torch._dynamo", "torch._inductor")):
                raise
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            raise DtrainError(
                f"training.compile={self.config.training.compile} failed while compiling the first "
                f"step ({type(exc).__name__}: {first}); set training.compile=none"
            ) from None
        if self.session.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - began
        self.timer.enabled = timing
        self.metrics.resume()
        self.metrics.leave_out_of_rates(
            sum(num_samples(batch) for batch in micro_batches), _tokens(micro_batches), seconds
        )
        self.monitor.info(
            f"compiled ({self.config.training.compile}) in the first step: {seconds:.1f} s, left out of throughput"
        )

    def _train_step(self, micro_batches: list[Any]) -> None:
        """One optimizer step over `grad_accum_steps` micro-batches (fewer at the end of an epoch)."""
        model, optimizer, scaler = self.model, self.optimizer, self.precision.scaler
        sizes = [num_samples(batch) for batch in micro_batches]  # shapes: no host sync
        n_step = sum(sizes)
        last = len(micro_batches) - 1
        for i, (batch, n) in enumerate(zip(micro_batches, sizes)):
            # Gradients are averaged across processes only on the last micro-batch; the others just
            # add into the local gradients.
            self.strategy.sync_gradients(i == last)
            with self.precision.autocast():
                loss, _, _ = self.loss_of(model, batch)
            if n != n_step:
                # Weight by samples, so the update equals one batch of all n_step samples.
                loss = loss * (n / n_step)
            scaler.scale(loss).backward()
            self.metrics.loss_sum += loss.detach()
        self.timer.backward_done()
        first = not self._first_backward_checked
        if first:
            self.strategy.after_first_backward()
            self._first_backward_checked = True
            grads = memory.gradient_bytes(self.module)
        if scaler.is_enabled():
            # fp16: true gradients before clipping, and (on the device) whether GradScaler skips
            # this step because they overflowed.
            scaler.unscale_(optimizer)
            found_inf = self.precision.found_inf(optimizer)
            if found_inf is not None:  # None: no gradient at all (GradScaler.step says so next)
                self.metrics.skipped_sum += found_inf
        if self.config.training.max_grad_norm > 0:
            self.metrics.add_grad_norm(self.strategy.clip_grad_norm(self.config.training.max_grad_norm))
        self._lr = optimizer.param_groups[0]["lr"]
        scaler.step(optimizer)
        scaler.update()
        if first:  # AdamW's state exists now: what this rank holds goes out with the next log step
            params, state = memory.state_bytes(self.module, optimizer)
            self.metrics.held = (params, grads, state)
            self.metrics.peak = lambda: memory.peak_bytes(self.session.device)
        optimizer.zero_grad(set_to_none=True)
        # A step GradScaler skipped advances the schedule here too: it is taken back at the next log
        # step, when the host learns of it without waiting on the device (see _log_train).
        self.scheduler.step()
        self.timer.step_done()
        self.metrics.step_done(n_step, tokens=_tokens(micro_batches))

    # --- evaluation -----------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """eval_loss (and eval_accuracy, eval_perplexity, the user's eval_metrics where they apply) over
        the whole eval set, reduced across ranks exactly (each sample counted once): see evaluation.py."""
        if self.eval_batches is None:
            return {}
        self.setup()
        # The module itself, not DDP's wrapper: no gradients, nothing to all-reduce. Under FSDP the forward
        # pass gathers parameters, a collective: every rank runs as many batches, the extra ones uncounted.
        module = self.module
        batches = (
            self.eval_batches.evened()
            if self.strategy.forward_is_collective
            else ((batch, True) for batch in self.eval_batches)
        )
        was_training = module.training
        module.eval()
        sums = EvalSums(self.session.device, self.eval_metrics)
        for batch, counted in batches:
            self.timer.progress.at("evaluation")
            with self.precision.autocast():
                loss, output, target = self.loss_of(module, batch)
            if counted:
                sums.add(loss, output, target, batch, num_samples(batch))
        module.train(was_training)
        return sums.result()

    def _should_evaluate(self, epoch_done: bool) -> bool:
        if self.eval_batches is None:
            return False
        if self.step == self.total_steps:
            return True
        every = self.config.training.eval_every
        return epoch_done and every > 0 and self.epoch % every == 0

    # --- logging --------------------------------------------------------------------------------

    def _log_train(self, stop_requested: bool) -> tuple[dict[str, Any], bool]:
        """Gather the window from every rank (the only host sync) and log it. The same gather carries
        each rank's stop request, so the group agrees to stop together."""
        stats, stop = self.metrics.take(stop_requested)
        record = {"step": self.step, "epoch": self.epoch, "time": time.time(), "lr": self._lr, **stats}
        if self.config.training.max_grad_norm <= 0:
            record.pop("grad_norm", None)
        if record.get("skipped_steps"):
            self._unschedule(record["skipped_steps"])
        self.monitor.log(record)
        if "param_bytes" in record:
            self.monitor.info(memory.describe(record, memory.peak_bytes(self.session.device)[1]))
        if not math.isfinite(record["loss"]):  # every rank has the same record: all stop here together
            raise DtrainError(self._diverged(f"the training loss became {record['loss']}"))
        return record, stop

    def _refuse_a_diverged_state(self) -> None:
        """Stop, on every rank, rather than write weights that are not finite (a checkpoint, the final
        weights): a loss can stay finite for the step whose update broke them."""
        broken = None if _finite(self.module.parameters()) else self._diverged("the weights became nan or inf")
        broken = distributed.first_error(broken)
        if broken:
            raise DtrainError(broken)

    def _diverged(self, what: str) -> str:
        cfg = self.config
        levers = [f"optimizer.lr={cfg.optimizer.lr / 10:g}"]
        if cfg.training.max_grad_norm <= 0:
            levers.append("training.max_grad_norm=1.0")
        if cfg.training.precision == "fp16":
            levers.append("training.precision=bf16")
        last = self.checkpointer.store.newest()  # never a diverged state: see _save_checkpoint
        if last is not None:
            again = (
                f"rerun with that change to resume from {last.path} (step {last.step}), or add "
                f"run.overwrite=true to start afresh"
            )
        else:
            again = "rerun with that change and run.overwrite=true to start afresh"
        return f"{what} by step {self.step}: training diverged and goes no further; try {' or '.join(levers)}: {again}"

    def _unschedule(self, skipped: int) -> None:
        """Take the steps GradScaler skipped back out of the LR schedule, so that it follows the
        optimizer's real updates (warm-up is not spent on steps that changed nothing). Every rank
        does it at the same log step, with the same count."""
        self.scheduler.last_epoch -= skipped + 1
        self.scheduler.step()  # recomputes every group's lr at the corrected position

    def _follow_the_configs_optimizer(self, wanted: dict[str, Any]) -> str | None:
        """The config's optimizer settings (momentum, weight decay, betas, …) over the checkpoint's, which
        loading its state brought back. What changed, or None."""
        restored = _hyperparameters(self.optimizer)
        changes = [
            f"optimizer.{key} {_plain(restored[key])} → {_plain(value)}"
            for key, value in wanted.items()
            if _plain(restored.get(key)) != _plain(value)
        ]
        for group in self.optimizer.param_groups:
            group.update(wanted)
        return ", ".join(changes) or None

    def _follow_the_configs_plan(self) -> str | None:
        """On resume the config governs, as in Lightning and torchtitan: a changed length
        (training.epochs / max_steps), schedule or peak learning rate rebuilds the LR schedule for the
        new plan at the restored position — the restored one would keep the old plan (and, extended
        past its end, train at its final learning rate, 0 for a decay). What changed, or None."""
        cfg = self.config
        restored, wanted = self.scheduler.lr_lambdas[0], LRShape(cfg.scheduler, self.total_steps)
        peak = cfg.optimizer.lr
        changes = [
            f"{label} {a:g} → {b:g}" if isinstance(a, (int, float)) else f"{label} {a} → {b}"
            for label, a, b in (
                ("steps", restored.total, wanted.total),
                ("scheduler.name", restored.name, wanted.name),
                ("scheduler.warmup_steps", restored.warmup, wanted.warmup),
                ("scheduler.min_lr_ratio", restored.floor, wanted.floor),
                ("optimizer.lr", self.scheduler.base_lrs[0], peak),
            )
            if a != b
        ]
        if not changes:
            return None
        self.scheduler.lr_lambdas = [LRShape(cfg.scheduler, self.total_steps) for _ in self.optimizer.param_groups]
        self.scheduler.base_lrs = [peak] * len(self.optimizer.param_groups)
        for group in self.optimizer.param_groups:
            group["initial_lr"] = peak
        self._unschedule(0)  # every group's lr for the restored position under the new plan
        return ", ".join(changes)

    def _log_eval(self) -> dict[str, Any]:
        self.metrics.pause()
        record = {"step": self.step, "epoch": self.epoch, "time": time.time(), **self.evaluate()}
        self.monitor.log(record)
        self.metrics.resume()
        return record


def _rescue_weights(state: dict[str, torch.Tensor]) -> str | None:
    """model.safetensors in a new folder of the first place with room: the system's temporary folder,
    /dev/shm (memory), the home folder, the current folder. Where it went, or None."""
    for place in dict.fromkeys([tempfile.gettempdir(), "/dev/shm", str(Path.home()), os.getcwd()]):
        folder = None
        try:
            folder = Path(tempfile.mkdtemp(prefix="dtrain-rescued-weights-", dir=place))
            save_final_weights(state, folder / "model.safetensors")
            return str(folder / "model.safetensors")
        except Exception:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
    return None


def _weights_bytes(module: nn.Module) -> int:
    """About the size of model.safetensors: every tensor of the state dict, plus room for its header."""
    return sum(t.numel() * t.element_size() for t in module.state_dict().values()) + (64 << 10)


def _out_of_memory(exc: BaseException) -> bool:
    """A CUDA OOM, or the CPU allocator's (a MemoryError, or torch's RuntimeError saying so)."""
    return isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(exc)
    )


def _tokens(micro_batches: list[Any]) -> int | None:
    """Tokens in a step's batches of token sequences (from shapes), or None for other data."""
    counts = [num_tokens(split(batch)[1]) for batch in micro_batches]
    return None if None in counts else sum(counts)


def _has_blocks(module: nn.Module, config: Config) -> bool:
    """Whether activation checkpointing could work on this model, block by block."""
    try:
        return bool(parallel.blocks.find_blocks(module, config.distributed.fsdp_units))
    except DtrainError:
        return False


# The optimizer settings a config sets besides the learning rate (which the schedule owns).
_HYPERPARAMETERS = ("momentum", "nesterov", "weight_decay", "betas", "eps")


def _hyperparameters(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    group = optimizer.param_groups[0]
    return {key: group[key] for key in _HYPERPARAMETERS if key in group}


def _plain(value: Any) -> Any:
    """A setting as the config writes it (a checkpoint's JSON makes betas a list)."""
    return list(value) if isinstance(value, tuple) else value


def _finite(tensors) -> bool:
    """Whether every value of these tensors (this rank's shards) is finite: one host sync."""
    from torch.distributed.tensor import DTensor

    checks = [torch.isfinite(t.to_local() if isinstance(t, DTensor) else t).all() for t in tensors]
    return bool(torch.stack(checks).all()) if checks else True
