"""The training loop: DDP, sharded batches, accumulation with `no_sync`, autocast, clipping, exact eval.

    trainer = dtrain.Trainer(config, model=net, train_data=train_set, eval_data=test_set)
    trainer.fit()

`Trainer.fit` runs in every process. Read `_train_step` top to bottom: it is the whole step.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset

from . import distributed
from .amp import precision_for
from .checkpoint import (Checkpointer, Parts, Position, RunDirLock, atomic_write_text, save_final_weights,
                         truncate_metrics)
from .comm import SharedMemoryAllReduce, shared_memory_hook
from .config import Config
from .data import EvalBatches, ShardSampler, TrainBatches
from .errors import DataError, DtrainError, Preempted
from .monitor import Monitor
from .optim import build_optimizer, build_scheduler
from .preemption import StopRequest

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Trainer:
    """Trains `model` data-parallel over every process of the job.

    `train_data` / `eval_data` are map-style data sets of (input, target) pairs; a `TensorDataset`
    takes the fast path (whole batches gathered by index). `loss_fn(output, target)` returns the mean
    loss of a batch (default: cross-entropy). After `setup()`, `model` is the DDP-wrapped module (the
    plain one at world size 1), `module` the user's own.
    """

    def __init__(self, config: Config | None = None, *, model: nn.Module, train_data: Dataset,
                 eval_data: Dataset | None = None, loss_fn: LossFn | None = None):
        self.config = config or Config()
        self.module = model
        self.train_data = train_data
        self.eval_data = eval_data
        self.loss_fn = loss_fn or F.cross_entropy
        self.session: distributed.Session | None = None
        self.model: nn.Module = model
        self.shared_memory: SharedMemoryAllReduce | None = None
        self.step = 0  # optimizer steps taken
        self.epoch = 0
        self.run_dir = Path(self.config.run.dir)

    # --- set-up ---------------------------------------------------------------------------------

    def setup(self) -> None:
        """Join the process group, wrap the model, build optimizer, schedule, batches and monitor.

        Everything that can refuse the job (precision, data sizes) is checked before anything is
        written to `run.dir`. Called by `fit()`; call it yourself to reach `self.model` first.
        """
        if self.session is not None:
            return
        self.session = distributed.start(self.config.distributed)
        self._lock = RunDirLock(self.run_dir)
        try:
            self._build()
        except BaseException:
            self._lock.release(remove_if_created=True)
            distributed.stop(self.session)
            raise

    def _build(self) -> None:
        cfg, session = self.config, self.session
        device = session.device
        self.precision = precision_for(cfg.training.precision, device)
        check_shardable(cfg, len(self.train_data), session.world_size)

        sampler = ShardSampler(len(self.train_data), session.rank, session.world_size, seed=cfg.run.seed)
        self.train_batches = TrainBatches(self.train_data, sampler, cfg.data, cfg.training.grad_accum_steps,
                                          device)
        self.eval_batches = (EvalBatches(self.eval_data, session.rank, session.world_size, cfg.data, device)
                             if self.eval_data is not None else None)
        if self.train_batches.steps_per_epoch == 0:
            raise DataError(f"data.drop_last=true with data.batch_size={cfg.data.batch_size} leaves no "
                            f"full batch of the {sampler.num_samples} samples per process; lower "
                            f"data.batch_size or set data.drop_last=false")

        self.module.to(device)
        if session.world_size > 1:
            dc = cfg.distributed
            self.model = DDP(self.module, device_ids=[device.index] if device.type == "cuda" else None,
                             bucket_cap_mb=dc.bucket_cap_mb,
                             gradient_as_bucket_view=dc.gradient_as_bucket_view,
                             static_graph=dc.static_graph, find_unused_parameters=dc.find_unused_parameters)
            self.shared_memory = self._share_gradients_in_memory()
        else:
            self.model = self.module
        self.optimizer = build_optimizer(cfg.optimizer, self.module.parameters())
        self.total_steps = self._planned_steps()
        self.scheduler = build_scheduler(cfg.scheduler, self.optimizer, self.total_steps)

        self._loss_sum = torch.zeros((), device=device)  # read on the host only at log steps
        self._norm_sum = torch.zeros((), device=device)
        self._window = _Window()

        self._take_run_dir()
        self.checkpointer = Checkpointer(cfg.checkpoint, self.run_dir, Parts(
            self.module, self.optimizer, self.scheduler, self.precision.scaler, session.rank,
            session.world_size, cfg.data.batch_size * cfg.training.grad_accum_steps))
        resume_from = self.checkpointer.find_resume_point()
        if resume_from is not None:
            position = self.checkpointer.restore(resume_from)
            self.step, self.epoch = position.step, position.epoch
        self._lr = self.optimizer.param_groups[0]["lr"]

        continuing = resume_from is not None and self.step < self.total_steps
        if session.is_main:
            atomic_write_text(self.run_dir / "config.toml", cfg.to_toml())
            if continuing:
                # An epoch that ended exactly at the checkpoint is evaluated again on resume.
                epoch_end_pending = self.step == (self.epoch + 1) * self.train_batches.steps_per_epoch
                truncate_metrics(self.run_dir / "metrics.jsonl", self.step, drop_eval_at_step=epoch_end_pending)
        self.monitor = Monitor(self.run_dir, session.is_main, self.total_steps, self.step,
                               purge_after=self.step if continuing else None)
        if resume_from is not None:
            self.monitor.info(f"resumed from {resume_from.path} (step {self.step} of {self.total_steps}, "
                              f"epoch {self.epoch})" + ("" if continuing else ": the run is already complete"))

    def _take_run_dir(self) -> None:
        """Rank 0 locks run.dir for the life of the run: two live runs must never share it."""
        error = None
        if self.session.is_main:
            try:
                self._lock.acquire()
            except DtrainError as exc:
                error = str(exc)
        error = distributed.first_error(error)
        if error:
            raise DtrainError(error)

    def _share_gradients_in_memory(self) -> SharedMemoryAllReduce | None:
        """On CPU with every rank on this machine, average gradients through shared memory."""
        session = self.session
        if not (self.config.distributed.shared_memory_allreduce and session.device.type == "cpu"
                and session.backend == "gloo" and session.env.local_world_size == session.world_size):
            return None
        state = SharedMemoryAllReduce.create(self.module, session.rank, session.world_size,
                                             session.env.local_world_size, self.config.distributed.timeout_s)
        if state is not None:
            self.model.register_comm_hook(state, shared_memory_hook)
        return state

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
        cfg = self.config.training
        last: dict[str, Any] = {}
        stop = StopRequest()
        stop.install()
        try:
            self.model.train()
            while self.step < self.total_steps:
                start = self.step - self.epoch * self.train_batches.steps_per_epoch
                for micro_batches in self.train_batches.epoch(self.epoch, start_step=start):
                    self._train_step(micro_batches)
                    self.step += 1
                    self.monitor.advance()
                    stopping = False
                    if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                        last, stopping = self._log_train(stop.requested)
                    elif self.session.world_size == 1:
                        stopping = stop.requested  # nobody to agree with: check every step
                    if stopping and self.step < self.total_steps:
                        self._save_checkpoint()
                        raise Preempted(f"stopped by SIGTERM at step {self.step}; checkpoint written to "
                                        f"{self.checkpointer.store.root}/step-{self.step}; rerun the same "
                                        f"command to resume")
                    if self._checkpoint_due():
                        self._save_checkpoint()
                    if self.step == cfg.stop_at_step:
                        if self.checkpointer.last_saved_step != self.step:
                            self._save_checkpoint()
                        self.monitor.info(f"stopped at step {self.step} as training.stop_at_step asks; "
                                          f"resume to continue")
                        distributed.barrier()
                        return last
                    if self.step == self.total_steps:
                        break
                epoch_done = self.step % self.train_batches.steps_per_epoch == 0
                if epoch_done:
                    self.epoch += 1
                if self._should_evaluate(epoch_done):
                    last = {**last, **self._log_eval()}
            if self.config.checkpoint.every_steps and self.checkpointer.last_saved_step != self.step:
                self._save_checkpoint()
            if self.session.is_main:
                save_final_weights(self.module, self.run_dir / "model.safetensors")
            distributed.barrier()
        finally:
            stop.uninstall()
            self.monitor.close()
            self._lock.release()
            distributed.stop(self.session)
        return last

    def _checkpoint_due(self) -> bool:
        every = self.config.checkpoint.every_steps
        return bool(every) and self.step % every == 0 and self.step < self.total_steps

    def _save_checkpoint(self) -> None:
        self._window.pause()
        checkpoint = self.checkpointer.save(Position(self.step, self.epoch))
        self._window.resume()
        self.monitor.info(f"checkpoint {checkpoint.name} written")

    def _train_step(self, micro_batches: list[tuple[Any, torch.Tensor]]) -> None:
        """One optimizer step over `grad_accum_steps` micro-batches (fewer at the end of an epoch)."""
        model, optimizer, scaler = self.model, self.optimizer, self.precision.scaler
        n_step = sum(len(target) for _, target in micro_batches)
        last = len(micro_batches) - 1
        for i, (inputs, target) in enumerate(micro_batches):
            if model is not self.module:
                # Gradients are all-reduced only on the last micro-batch (DDP's no_sync, as a flag);
                # the others just add into the local .grad.
                model.require_backward_grad_sync = i == last
            with self.precision.autocast():
                loss = self.loss_fn(_forward(model, inputs), target)
            if len(target) != n_step:
                # Weight by samples, so the update equals one batch of all n_step samples.
                loss = loss * (len(target) / n_step)
            scaler.scale(loss).backward()
            self._loss_sum += loss.detach()
        if self.config.training.max_grad_norm > 0:
            scaler.unscale_(optimizer)
            self._norm_sum += nn.utils.clip_grad_norm_(self.module.parameters(),
                                                       self.config.training.max_grad_norm)
        self._lr = optimizer.param_groups[0]["lr"]
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self._window.add(n_step)

    # --- evaluation -----------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Loss and accuracy over the whole eval set, reduced across ranks exactly (no padding)."""
        if self.eval_batches is None:
            return {}
        self.setup()
        module = self.module  # no DDP in eval: nothing to all-reduce inside the forward pass
        was_training = module.training
        module.eval()
        # loss·samples, correct, samples — summed in float64 so the reduction is exact.
        sums = torch.zeros(3, dtype=torch.float64, device=self.session.device)
        classify = True
        for inputs, target in self.eval_batches:
            with self.precision.autocast():
                output = _forward(module, inputs)
                loss = self.loss_fn(output, target)
            sums[0] += loss.double() * len(target)
            classify = classify and output.dim() == 2 and target.dim() == 1 and not target.is_floating_point()
            if classify:
                sums[1] += (output.argmax(dim=1) == target).sum()
            sums[2] += len(target)
        module.train(was_training)
        loss_sum, correct, count = distributed.all_reduce_sum(sums).tolist()
        result = {"eval_loss": loss_sum / count, "eval_samples": int(count)}
        if classify:
            result["eval_accuracy"] = correct / count
        return result

    def _should_evaluate(self, epoch_done: bool) -> bool:
        if self.eval_batches is None:
            return False
        if self.step == self.total_steps:
            return True
        every = self.config.training.eval_every
        return epoch_done and every > 0 and self.epoch % every == 0

    # --- logging --------------------------------------------------------------------------------

    def _log_train(self, stop_requested: bool) -> tuple[dict[str, Any], bool]:
        """Reduce the window's device accumulators across ranks and read them: the only host sync.

        The same all-reduce carries each rank's stop request, so the group agrees to stop together.
        Returns the record and whether any rank asked to stop.
        """
        stop = torch.tensor(float(stop_requested), device=self._loss_sum.device)
        sums = distributed.all_reduce_sum(torch.stack([self._loss_sum, self._norm_sum, stop]))
        per_step = self._window.steps * self.session.world_size
        loss, grad_norm, stops = (sums / torch.tensor([per_step, per_step, 1], device=sums.device)).tolist()
        self._loss_sum.zero_()
        self._norm_sum.zero_()
        samples, seconds = self._window.take()
        record = {
            "step": self.step,
            "epoch": self.epoch,
            "time": time.time(),
            "loss": loss,
            "lr": self._lr,
            "samples_per_s": samples * self.session.world_size / seconds,
        }
        if self.config.training.max_grad_norm > 0:
            record["grad_norm"] = grad_norm
        self.monitor.log(record)
        return record, stops > 0

    def _log_eval(self) -> dict[str, Any]:
        self._window.pause()
        record = {"step": self.step, "epoch": self.epoch, "time": time.time(), **self.evaluate()}
        self.monitor.log(record)
        self._window.resume()
        return record


class _Window:
    """Samples and wall time since the last log line (eval time excluded)."""

    def __init__(self):
        self.steps = 0
        self.samples = 0
        self._start = time.perf_counter()
        self._paused_at: float | None = None

    def add(self, samples: int) -> None:
        self.steps += 1
        self.samples += samples

    def take(self) -> tuple[int, float]:
        now = time.perf_counter()
        result = (self.samples, max(now - self._start, 1e-9))
        self.steps, self.samples, self._start = 0, 0, now
        return result

    def pause(self) -> None:
        self._paused_at = time.perf_counter()

    def resume(self) -> None:
        if self._paused_at is not None:
            self._start += time.perf_counter() - self._paused_at
            self._paused_at = None


def _forward(model: nn.Module, inputs: Any) -> torch.Tensor:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def check_shardable(config: Config, n_train: int, world_size: int) -> None:
    """Every process needs at least one training sample of its own."""
    if n_train < world_size:
        raise DataError(f"data set '{config.data.name}' has {n_train} training samples, too few for "
                        f"{world_size} processes; use --nproc {max(1, n_train)} or fewer")
