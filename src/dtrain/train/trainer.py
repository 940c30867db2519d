"""The training loop: the model spread by a strategy (DDP, FSDP), sharded batches, accumulation without
sync, autocast, clipping, exact eval.

    trainer = dtrain.Trainer(config, model=net, train_data=train_set, eval_data=test_set)
    trainer.fit()

`Trainer.fit` runs in every process. Read `_train_step` top to bottom: it is the whole step. Policies live
in collaborators: train.resume, .stopping, .evaluation, .advice; rundir.claim; export.weights; observe.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader, Dataset

from dtrain import data, distributed, parallel
from dtrain.checkpoint import Parts, Position, init_from
from dtrain.checkpoint.checkpointer import Checkpointer
from dtrain.config import Config, profile_range
from dtrain.data import Batches
from dtrain.errors import DtrainError
from dtrain.export import weights as export
from dtrain.models import lora
from dtrain.observe import memory
from dtrain.observe.metrics import StepMetrics, step_tokens
from dtrain.observe.monitor import Monitor
from dtrain.observe.profiling import StepProfiler
from dtrain.observe.steptime import StepTimer
from dtrain.observe.watchdog import HangWatch
from dtrain.parallel.base import Strategy
from dtrain.parallel.options import StrategyOptions
from dtrain.rundir import resume_point
from dtrain.rundir.claim import RunDirClaim
from dtrain.rundir.mirror import local_dir
from dtrain.train import advice, optim, resume
from dtrain.train.amp import Precision, precision_for
from dtrain.train.compiling import compiling_step
from dtrain.train.evaluation import EvalMetrics, Evaluator
from dtrain.train.loss import LossFn, LossOf, StepFn, StepShares
from dtrain.train.schedules import Schedule
from dtrain.train.stopping import StopAgreement, StopRequest, abandoned


@dataclass
class _Built:
    """What set-up builds for a session before it claims run.dir (`Trainer._build`)."""

    strategy: parallel.Strategy
    precision: Precision
    batches: Batches
    timer: StepTimer
    metrics: StepMetrics
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler | Schedule
    evaluator: Evaluator | None  # None: no eval data


@dataclass
class _Run(_Built):
    """What `setup()` builds, made there whole: the methods that train take it, and none of it is None."""

    session: distributed.Session
    claim: RunDirClaim  # run.dir, held by this run
    checkpointer: Checkpointer
    monitor: Monitor


class Trainer:
    """Trains `model` data-parallel over every process of the job.

    `train_data` / `eval_data` are map-style data sets whose samples may be any shape: tensors, tuples,
    dicts (Hugging Face's included), namedtuples, dataclasses, nested; collated by `collate_fn` (default:
    `default_collate`, dataclasses too). A `TensorDataset` of any number of tensors, or a dict of equally
    long tensors, takes the fast path (whole batches gathered by index). `train_data` may also be an
    iterable data set (data.streams) or a DataLoader (data.given). The loss: `step_fn(model,
    batch)`; else a dict batch's `model(**batch).loss` (or `loss_fn(output, batch)`); else
    `loss_fn(model(inputs), target)` for an `(inputs, target)` batch (default: cross-entropy) — see
    loss.py. `eval_metrics(output, batch)` returns more per-batch means, averaged over every eval sample
    exactly; `eval_metrics=dtrain.whole_split(fn)` scores `fn(predictions, targets)` of the whole split.
    `optimizer`, `scheduler`: objects or factories, else the config's (optim.py); `tp_plan` splits the model
    under `parallel.tp_size` (parallel/tensor.py). After `setup()`, `strategy` spreads the model over
    the processes (`parallel.strategy`), `model` is what the step calls (DDP's wrapper; FSDP's sharded
    module; the plain module at one process), `module` yours.
    """

    def __init__(
        self,
        config: Config | None = None,
        *,
        model: nn.Module,
        train_data: Dataset | Mapping[str, torch.Tensor] | DataLoader,
        eval_data: Dataset | Mapping[str, torch.Tensor] | DataLoader | None = None,
        loss_fn: LossFn | None = None,
        step_fn: StepFn | None = None,
        eval_metrics: EvalMetrics | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        optimizer: optim.OptimizerArg | None = None,
        scheduler: optim.SchedulerArg | None = None,
        tp_plan: Mapping[str, Any] | None = None,
    ):
        # A dict of tensors becomes a TensorDict; a DataLoader gives its data set and settings (data.given).
        given = data.as_given(config or Config(), train_data, eval_data, collate_fn, model)
        self.config, self.train_data, self.eval_data, collate_fn = given
        self.module, self.tp_plan = model, tp_plan  # tensor parallel: module patterns → styles (parallel.tensor)
        self.loss_of, self.eval_metrics, self.collate_fn = LossOf(step_fn, loss_fn), eval_metrics, collate_fn
        self.model: nn.Module = model
        self.step, self.epoch = 0, 0  # optimizer steps taken, epochs done (lines say epochs from 1: _epoch_said)
        self.run_dir = local_dir(self.config.run.dir)  # for s3://: the staging folder the store mirrors
        self.checkpoint_parts: dict[str, Any] = {}  # more state to checkpoint: see register_for_checkpointing
        # How the run continues a checkpoint. A regroup changes the accumulation the run uses: the
        # caller's config is never changed, `self.config` becomes a copy saying what the run used.
        self.plan = resume.ResumePlan(self.config, self.run_dir)
        self.grad_accum_steps = self.config.training.grad_accum_steps
        self.total_steps, self.given_optim = 0, (optimizer, scheduler)  # objects or factories, else the config's
        self._run: _Run | None = None  # what setup() builds
        self._lr, self._left_together = 0.0, False  # the last step's lr (logged); every rank left fit() in step
        self.stop_request = StopRequest()  # SIGTERM's and Ctrl-C's flag, from set-up on: see stopping.py

    # What setup() built, for a caller to reach (None before it).
    @property
    def session(self) -> distributed.Session | None:
        return self._run.session if self._run else None

    @property
    def strategy(self) -> parallel.Strategy | None:
        """How the model is spread over the processes (`parallel.strategy`)."""
        return self._run.strategy if self._run else None

    @property
    def parallel(self) -> parallel.Strategy | None:
        """The strategy, by its name before 0.2 (`strategy` now, as in Lightning Fabric)."""
        return self.strategy

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._run.optimizer if self._run else None

    @property
    def scheduler(self) -> LRScheduler | Schedule | None:
        return self._run.scheduler if self._run else None

    @property
    def precision(self) -> Precision | None:
        """Mixed precision as the run computes: its autocast and GradScaler (train/amp.py)."""
        return self._run.precision if self._run else None

    @property
    def train_batches(self) -> Batches | None:
        """This rank's batches of the training data (its shard, grouped for accumulation)."""
        return self._run.batches if self._run else None

    @property
    def checkpointer(self) -> Checkpointer | None:
        return self._run.checkpointer if self._run else None

    @property
    def monitor(self) -> Monitor | None:
        return self._run.monitor if self._run else None

    def register_for_checkpointing(self, **parts: Any) -> None:
        """Checkpoint these objects with the run and restore them on resume, by name (`ema=ema`). Each has
        `state_dict()` and `load_state_dict()` (torch's Stateful protocol), as Accelerate's
        `register_for_checkpointing` asks. Call it before `setup()` or `fit()`: resuming happens in set-up."""
        resume.check_stateful(parts, set_up=self._run is not None)
        self.checkpoint_parts.update(parts)

    def setup(self) -> None:
        """Join the process group, wrap the model, build optimizer, schedule, batches and monitor. Everything
        that can refuse the job (precision, data sizes) is checked before anything is written to `run.dir`.
        Called by `fit()`; call it yourself to reach `self.model` first."""
        self._set_up()

    def _set_up(self) -> _Run:
        """The run, made on the first call (see setup)."""
        if self._run is not None:
            return self._run
        cfg, diagnostics = self.config, self.run_dir / "diagnostics"
        session = distributed.start(
            cfg.distributed, debug=cfg.monitor.debug, diagnostics_dir=diagnostics, device=cfg.training.device
        )
        claim, monitor = RunDirClaim(self.run_dir, cfg.run, session.is_main, cfg.checkpoint), None
        try:
            built = self._build(session)
            checkpointer = self._resume(session, claim, built)
            followed, per_epoch = self.config, built.batches.steps_per_epoch  # after a regroup: _build's copy
            at = (self.step, self.epoch)
            monitor = self.plan.start_outputs(followed, session, claim.said(), *at, per_epoch, self.total_steps)
            checkpointer.report = claim.sending(monitor.log)  # each sealed checkpoint's times (to a store)
        except BaseException as exc:
            claim.forget(self.step, functools.partial(monitor.close, exc) if monitor else None)
            self.stop_request.uninstall()
            claim.release(remove_if_created=True)
            distributed.stop(session)
            if advice.is_out_of_memory(exc):
                when = "while setting up (model, data held on the device)"
                raise self._out_of_memory(session, None, when, exc) from None
            raise
        # The parts _build made, and the rest.
        self._run = _Run(**vars(built), session=session, claim=claim, checkpointer=checkpointer, monitor=monitor)
        return self._run

    def _out_of_memory(
        self, session: distributed.Session, strategy: Strategy | None, when: str, exc: BaseException
    ) -> DtrainError:
        return advice.out_of_memory(when, exc, self.config, self.module, session, self.grad_accum_steps, strategy)

    def _build(self, session: distributed.Session) -> _Built:
        cfg, device, dims = self.config, session.device, parallel.layout(self.config, session)
        rank, dp = dims.dp_rank(session.rank), dims.dp  # a replica's tensor and pipeline peers share samples
        advice.check_trainable(self.module)
        precision = precision_for(cfg.training.precision, device, cfg.training.tf32)
        global_order = data.keeps_global_order(self.train_data, cfg.data.sampling)
        self.grad_accum_steps = accum = self.plan.regroup(session, global_order, dp)
        self.config = cfg = self.plan.followed(cfg)  # after a regroup a copy: the caller's config stays as given
        made = data.train_batches(self.train_data, cfg, rank, dp, accum, global_order, device, self.collate_fn)
        batches = made  # a map-style set's shard, or an iterable set's share (streams.py)
        if lora.wanted(cfg, self.module) and cfg.model.weights:  # LoRA: the base weights read, then adapters in
            init_from.load_into(self.module, init_from.resolve(*cfg.model.weights), session.is_main)
        self.module = lora.prepare(cfg, self.module)
        parallel.to_device(self.module, device)  # a model on the meta device: its buffers (deferred.py)
        timer = StepTimer(device, enabled=cfg.monitor.breakdown)
        skips, world, loss_of = precision.scaler.is_enabled(), session.world_size, self.loss_of
        metrics = StepMetrics.for_run(cfg, device, world, timer, self.module, batches, loss_of, skips, dims)
        default_loss = self.loss_of.is_default  # dtrain's cross-entropy: tensor parallel may split the logits
        options = StrategyOptions.of(cfg)  # what the strategy reads of the config
        strategy = parallel.build(options, session, self.module, timer, dims, self.tp_plan, default_loss)
        timer.comm_inside_compute = strategy.comm_in_compute  # no comm phase of its own to time
        self.model, self.module = strategy.model, strategy.module  # a pipeline: its stages' part
        self.total_steps = optim.planned_steps(cfg.training, batches.steps_per_epoch)
        optimizer, scheduler = optim.build(cfg, self.module, self.given_optim, device, self.total_steps)
        evaluator = Evaluator.of(
            self.eval_data, session, dims, cfg, self.collate_fn, self.loss_of, self.eval_metrics, precision, timer
        )
        return _Built(strategy, precision, batches, timer, metrics, optimizer, scheduler, evaluator)

    def _resume(self, session: distributed.Session, claim: RunDirClaim, built: _Built) -> Checkpointer:
        """Claim run.dir and resume from its newest checkpoint (if any): the run's checkpointer."""
        cfg, samples_per_step = self.config, self.config.data.batch_size * self.grad_accum_steps  # per data rank
        dp = built.metrics.data_ranks  # the processes drawing distinct samples (tensor, pipeline peers share)
        self.stop_request.install()  # from here a SIGTERM must not end the process mid-write
        claim.take(self.module, self.stop_request.lose_run_dir)  # the lease on a store lost: the run stops
        scaler, rank, world = built.precision.scaler, session.rank, session.world_size
        held = (self.module, built.optimizer, built.scheduler, scaler, rank, world)
        per_epoch, total, stage = built.batches.steps_per_epoch, self.total_steps, built.strategy.stage
        identity, spread = resume.identity(cfg, data.samples_in(self.train_data)), resume.spread(cfg)
        plan, extra = resume.plan(cfg, total, per_epoch), {**self.checkpoint_parts, **built.batches.parts()}
        parts = Parts(*held, samples_per_step, identity=identity, extra=extra, setup=spread, plan=plan, data_ranks=dp)
        parts.stage = stage  # a pipeline stage's place in the whole model, for its checkpoints
        checkpointer = Checkpointer(cfg.checkpoint, self.run_dir, parts, claim.checkpoints)
        store, at = checkpointer.store, lambda: self.step
        self.stop_request.abandon_line = lambda: abandoned(at(), store) if session.is_main else None  # 2nd Ctrl-C
        resume_from = checkpointer.find_resume_point(resume_point.chooser(cfg.checkpoint))
        claim.fresh = resume_from is None  # what run.dir holds from here on is this run's own
        if resume_from is not None:
            position = self.plan.restore(checkpointer, resume_from, built.scheduler, total)
            self.step, self.epoch = position.step, position.epoch
            built.metrics.skipped_sum.fill_(position.unscheduled_skips)
        elif cfg.model.weights and not lora.of(self.module):  # a new run: the weights of init_from (or of an hf:
            weights = init_from.resolve(*cfg.model.weights)  # folder), into the spread model
            init_from.load_into(self.module, weights, session.is_main, stage)
        return checkpointer

    def fit(self) -> dict[str, Any]:
        """Train for `training.epochs` (or `max_steps`); the last logged metrics. SIGTERM: a checkpoint, `Preempted`."""
        run = self._set_up()
        cfg, session, claim, monitor = self.config, run.session, run.claim, run.monitor
        rank, world, cuda = session.rank, session.world_size, session.device.type == "cuda"
        stopping = StopAgreement(cfg.training, cfg.checkpoint, world, self.stop_request, session.is_main)
        profiler = StepProfiler(profile_range(cfg.profile.steps), self.run_dir, rank, cuda)
        run.timer.progress.step = self.step
        watch = HangWatch(run.timer.progress, cfg.distributed.hang_timeout_s, rank, world, self.run_dir)
        self._left_together = False
        with contextlib.ExitStack() as held:  # released in reverse order: the process group last
            held.callback(lambda: distributed.stop(session, self._left_together or stopping.left_together))
            held.push(claim.end)  # released; a lease lost on a store after the last step is said
            held.callback(lambda: None if self._left_together else claim.forget(self.step, monitor.close))
            held.enter_context(stopping.request)  # SIGTERM or Ctrl-C asks the run to stop: see stopping.py
            # A failed run's trackers say so, ended while a SIGTERM (a failed job's other ranks being
            # stopped) still only sets the flag: it must not cut their last writes short.
            held.push(lambda _kind, error, _trace: monitor.close(error))
            held.callback(profiler.close)
            held.callback(run.batches.close)  # DataLoader workers end with the run, not when collected
            watch.start()
            held.callback(watch.stop)
            # One gather (also the barrier keeping rank 0's extra set-up out of the others' waiting): a
            # SIGTERM during set-up stops the group before its first step; a new run leaves nothing behind.
            if stopping.requested_by_any():
                stopped = stopping.preempted_before_training(self.step)
                claim.forget(self.step, lambda: monitor.close(stopped))  # the trackers' runs: KILLED
                self._left_together = True
                raise stopped

            def out_of_memory(exc: BaseException) -> DtrainError:  # said with the step it happened at
                return self._out_of_memory(session, run.strategy, f"at step {self.step + 1}", exc)

            with advice.out_of_memory_said(out_of_memory):
                return self._train(run, stopping, profiler)

    def _train(self, run: _Run, stopping: StopAgreement, profiler: StepProfiler) -> dict[str, Any]:
        """The loop, from this run's position to its end or a stop all ranks agree on."""
        total, mode = self.total_steps, self.config.training.compile
        compiling = mode != "none"  # torch.compile compiles on the first call
        run.metrics.restart()
        self.model.train()
        batches, first_step = resume.batch_stream(run.batches, self.step), self.step
        # Resumed at an epoch's end: counted, and evaluated unless metrics.jsonl holds that evaluation already.
        last: dict[str, Any] = (
            self._end_epoch_if_done(run, {}, self.plan.evaluated_at_resume) if self.step < total else {}
        )
        while self.step < total and not stopping.step_reached(self.step, total):
            profiler.before_step(self.step + 1)
            began = time.perf_counter()
            run.timer.start()
            micro_batches = next(batches)
            run.timer.data_ready()
            if compiling:
                compiling = False
                step = functools.partial(self._train_step, run)
                compiling_step(step, micro_batches, mode, run.metrics, run.timer, run.monitor.info)
            else:
                self._train_step(run, micro_batches)
            self.step += 1
            run.monitor.advance()
            if self.step == first_step + 2:  # the first step compiles and warms up: the second is typical
                stopping.pace(time.perf_counter() - began)
            if self.step % self.config.training.log_every == 0 or self.step == total:  # gathers every SIGTERM
                last, preempted = self._log_train(run, stopping.request.requested)
                stopping.repace(last)  # the window's step time, the same on every rank: the pace again
            else:
                preempted = stopping.between_log_steps(self.step)
            preempted, planned_stop = stopping.decide(preempted, self.step, total)  # run.dir lost: raises
            if run.checkpointer.due(self.step, last=self.step == total, forced=preempted or planned_stop):
                self._save_checkpoint(run, background=not preempted)  # with checkpoint.async; a stop waits for it
            if preempted:
                self._left_together = True
                raise stopping.preempted(self.step, run.checkpointer.store.root)
            if self.step < total and planned_stop:
                break
            last = self._end_epoch_if_done(run, last)
        run.checkpointer.finish(self.step, last=True)  # a checkpoint written in the background sealed first
        if self.step < total:  # at training.stop_at_step
            run.monitor.info(stopping.stopped_early(self.step, first_step))
        elif not self.plan.weights_kept:  # model.safetensors, or the trained state kept and the run saying where
            advice.refuse_a_diverged_state(self.module, self.step, self.config, run.checkpointer.store)
            state = lora.saved(self.module, run.strategy.full_state_dict())  # a collective under FSDP
            path, save = self.run_dir / "model.safetensors", functools.partial(self._save_checkpoint, run)
            export.write_final_weights(state, path, run.session.is_main, run.checkpointer, self.step, save)
            # The end's checkpoint (checkpoint.at_end), or SIGTERM near the end: the rerun finds the run complete.
            ending = run.checkpointer.at_end(self.step) or stopping.requested_by_any()  # collective unless at_end
            if ending and run.checkpointer.last_saved_step != self.step:
                self._save_checkpoint(run)
        distributed.barrier()
        self._left_together = True
        return last

    def _end_epoch_if_done(self, run: _Run, last: dict[str, Any], evaluated: bool = False) -> dict[str, Any]:
        """At the end of an epoch, count it; evaluate when `training.eval_every` asks, and after the last step
        (unless `evaluated` already)."""
        epoch_done = self.step == (self.epoch + 1) * run.batches.steps_per_epoch
        self.epoch += int(epoch_done)
        due = run.evaluator and run.evaluator.should_evaluate(self.step, self.total_steps, self.epoch, epoch_done)
        if evaluated or not due:
            return last
        with run.metrics.paused():  # evaluation is not training time; train_loss: the mean since the last one
            said = {"step": self.step, "epoch": self._epoch_said(run), "time": time.time(), **run.metrics.since_eval()}
            run.monitor.log(record := {**said, **self.evaluate()})
        run.checkpointer.consider_best(self.step, record)  # checkpoint.keep_best: the step's checkpoint came first
        return {**last, **record}

    def _epoch_said(self, run: _Run) -> int:
        return resume.epoch_of(self.step, run.batches.steps_per_epoch)

    def _train_step(self, run: _Run, micro_batches: list[Any]) -> None:
        """One optimizer step over `grad_accum_steps` micro-batches (fewer at the end of an epoch)."""
        model, optimizer, scaler, metrics = self.model, run.optimizer, run.precision.scaler, run.metrics
        # Each micro-batch's share of the step's loss (by target tokens across every rank for a token-mean
        # loss, else by samples), so the update equals one batch of all the step's samples.
        with run.strategy.step_context(micro_batches):  # context parallel, loss parallel (parallel/base.py)
            shares = StepShares(self.loss_of, model, micro_batches, run.metrics.world_size)
            # Forward and backward over the micro-batches: one after another, or a pipeline's schedule.
            metrics.loss_sum += run.strategy.forward_backward(micro_batches, shares, run.precision)
        run.timer.backward_done()
        if metrics.after_backward(self.module):  # the first step's: its gradients measured once
            run.strategy.after_first_backward()
        if scaler.is_enabled():
            # fp16: true gradients before clipping, and (on the device) whether GradScaler skips an overflow.
            scaler.unscale_(optimizer)
            found_inf = run.precision.found_inf(optimizer)
            if found_inf is not None:  # None: no gradient at all (GradScaler.step says so next)
                metrics.skipped_sum += found_inf
        if self.config.training.max_grad_norm > 0:
            metrics.add_grad_norm(run.strategy.clip_grad_norm(self.config.training.max_grad_norm))
        self._lr = optimizer.param_groups[0]["lr"]
        scaler.step(optimizer)
        scaler.update()
        metrics.after_update(self.module, optimizer)  # the first step's: what this rank holds, measured once
        optimizer.zero_grad(set_to_none=True)
        # A step GradScaler skipped advances the schedule here too: it is taken back at the next log
        # step, when the host learns of it without waiting on the device (see _log_train).
        run.scheduler.step()
        run.timer.step_done()
        metrics.step_done(sum(shares.sizes), tokens=step_tokens(micro_batches))

    def evaluate(self) -> dict[str, float]:
        """eval_loss (and eval_accuracy, eval_perplexity, the user's eval_metrics where they apply) over the eval
        set, reduced across ranks exactly (see evaluation.py). Sets the run up first if `setup()` has not run."""
        if self.eval_data is None:
            return {}
        run = self._set_up()
        return run.evaluator.evaluate(run.strategy, run.session.device) if run.evaluator else {}

    def _log_train(self, run: _Run, stop_requested: bool) -> tuple[dict[str, Any], bool]:
        """Gather the window from every rank (the only host sync) and log it. The same gather carries
        each rank's stop request, so the group agrees to stop together."""
        stats, stop = run.metrics.take(stop_requested)
        record = {"step": self.step, "epoch": self._epoch_said(run), "time": time.time(), "lr": self._lr, **stats}
        if record.get("skipped_steps"):
            resume.unschedule(run.scheduler, record["skipped_steps"])
        run.monitor.log(record)
        run.checkpointer.poll(self.step)  # a checkpoint written in the background, reported once sealed
        if "param_bytes" in record:
            run.monitor.info(memory.describe(record, memory.peak_bytes(run.session.device)[1]))
        advice.refuse_a_diverged_loss(record["loss"], self.step, self.config, run.checkpointer.store)
        return record, stop

    def _save_checkpoint(self, run: _Run, background: bool = False) -> None:
        with run.metrics.paused():
            run.timer.progress.at("checkpoint")
            # Never a checkpoint of weights that are not finite: a rerun would resume into them.
            advice.refuse_a_diverged_state(self.module, self.step, self.config, run.checkpointer.store)
            position = Position(self.step, self.epoch, unscheduled_skips=int(run.metrics.skipped_sum.item()))
            run.checkpointer.checkpoint(position, wait=not background)  # reported to the monitor once sealed
