"""Resuming a run where the config governs, as in Lightning and torchtitan.

A checkpoint brings back the optimizer, schedule and position it was written with. The config of the
resumed run may differ: another number of processes or data.batch_size (the accumulation changes to
keep the checkpoint's global batches: `ResumePlan.regroup`), another length, schedule, learning rate or
optimizer setting (the config's win: `ResumePlan.restore`), another strategy or precision (said, not
refused). `ResumePlan.lines` says on the console what changed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dtrain import distributed, rundir
from dtrain.checkpoint import Checkpoint, Position
from dtrain.checkpoint.checkpointer import Checkpointer
from dtrain.checkpoint.state import BUILT_IN_PARTS, HEADER, NOTHING_TO_TRAIN, epoch_of, processes, regroup
from dtrain.config import RENAMED, Config, with_global_batch
from dtrain.data import Batches
from dtrain.errors import DtrainError
from dtrain.files import atomic_write_text
from dtrain.models import lora
from dtrain.observe.metrics_file import evaluated_at, truncate_metrics
from dtrain.observe.monitor import Monitor
from dtrain.observe.trackers import restart_line
from dtrain.rundir.resume_point import resume_geometry
from dtrain.train.schedules import Schedule

# A group's keys that are not its settings: its parameters, and the learning rate (which the schedule owns).
_NOT_SETTINGS = ("params", "lr", "initial_lr", "param_names")
# How torch computes (fused on CUDA, ...): this run's choice, never a change to report.
_IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")


class ResumePlan:
    """How this run continues the checkpoint it resumes from, and what it says about it."""

    def __init__(self, config: Config, run_dir: Path):
        self.config, self.run_dir = config, run_dir
        self.grad_accum_steps = config.training.grad_accum_steps  # the effective one, after regroup
        self.regrouped: str | None = None  # the console line of a changed accumulation
        self.resumed_from: Checkpoint | None = None
        self.replanned: str | None = None  # what of the config changed since the checkpoint
        self.rescheduled = False
        # The evaluation due at the checkpoint's step is in metrics.jsonl already (the checkpoint came first,
        # then the evaluation was logged: a finished run's end, or one stopped just after): not run again.
        self.evaluated_at_resume = False
        # A finished run rerun found its final weights there: they are not written again.
        self.weights_kept = False
        # Whether `config` built the model and data (worker.run: `dtrain run`); else they were given in code
        # and config.toml says so, since its [model] and [data] do not describe them.
        self.described_by_config = False

    def regroup(self, session: distributed.Session, global_order: bool, data_ranks: int) -> int:
        """Resuming a checkpoint written by another number of processes (a node lost for good, a job
        requeued on another allocation), or with another data.batch_size: the same global sample
        position and global batches, the accumulation changed to make them up (see
        checkpoint.state.regroup); on another number of processes only token data can, other data is
        refused. The accumulation this run uses (the config is left as it is); training.global_batch_size
        first makes up the config's own for this world size. `data_ranks`: the processes drawing distinct
        samples (the data-parallel ones: every process but for tensor and pipeline parallel)."""
        cfg = self.config = with_global_batch(self.config, data_ranks)
        self.grad_accum_steps = cfg.training.grad_accum_steps

        def decide() -> tuple[str, int, int] | None:
            fresh = cfg.run.overwrite and not distributed.later_attempt()
            saved = resume_geometry(cfg.checkpoint, self.run_dir, fresh=fresh)
            if saved is None or not saved[2]:
                return None
            world, batch_size, accum = data_ranks, cfg.data.batch_size, cfg.training.grad_accum_steps
            stated = cfg.training.global_batch_size
            return saved[0], saved[1], regroup(*saved, world, batch_size, accum, global_order, stated)

        found = distributed.rank0_decides(decide, is_main=session.is_main)
        if found is not None and found[2] != cfg.training.grad_accum_steps:
            self.grad_accum_steps = found[2]
            self.regrouped = self._regrouped_line(*found, data_ranks)
        return self.grad_accum_steps

    def followed(self, config: Config) -> Config:
        """`config` as this run follows it: the same object, or after a regroup a copy with the accumulation
        used (the caller's config is never changed; config.toml and the trackers get the copy)."""
        if self.grad_accum_steps == config.training.grad_accum_steps:
            return config
        return dataclasses.replace(
            config, training=dataclasses.replace(config.training, grad_accum_steps=self.grad_accum_steps)
        )

    def _regrouped_line(self, name: str, saved_world: int, accum: int, world: int) -> str:
        before, batch_size = self.config.training.grad_accum_steps, self.config.data.batch_size
        global_batch = accum * batch_size * world
        if saved_world == world:  # another data.batch_size, or a checkpoint of a regrouped run
            return (
                f"{name} took global batches of {global_batch} samples: with data.batch_size="
                f"{batch_size} on {processes(world)}, training.grad_accum_steps {accum} (not the "
                f"config's {before}) keeps them"
            )
        return (
            f"{name} was written by {processes(saved_world)} and this run has {world}: "
            f"training.grad_accum_steps {before} → {accum} keeps its global batch of {global_batch} samples"
        )

    def restore(
        self,
        checkpointer: Checkpointer,
        resume_from: Checkpoint,
        scheduler: torch.optim.lr_scheduler.LRScheduler | Schedule,
        total_steps: int,
    ) -> Position:
        """Load `resume_from`, then put the config's plan and optimizer settings over the checkpoint's."""
        cfg = self.config
        if resume_from.step > total_steps:
            raise DtrainError(
                f"{resume_from.path} is at step {resume_from.step} and this config plans "
                f"{total_steps} steps (training.epochs={cfg.training.epochs}, "
                f"training.max_steps={cfg.training.max_steps}); raise them to continue "
                f"that run, or start a new run.dir"
            )
        optimizer = scheduler.optimizer
        driven = scheduler.drives if isinstance(scheduler, Schedule) else ()
        wanted = _settings(optimizer, driven)  # the config's, before the checkpoint's replace them
        position = checkpointer.restore(resume_from)
        saved = {RENAMED.get(key, key): value for key, value in position.setup.items()}  # older names too
        respread = ", ".join(
            f"{key} {saved[key]} → {value}"
            for key, value in checkpointer.parts.setup.items()
            if key in saved and saved[key] != value
        )
        # A Schedule loaded a checkpoint of another plan (length, schedule, peak) by rebuilding this one's.
        rescheduled = scheduler.replanned if isinstance(scheduler, Schedule) else None
        changes = (rescheduled, follow_the_configs_optimizer(optimizer, wanted), respread)
        self.resumed_from, self.rescheduled = resume_from, rescheduled is not None
        self.replanned = ", ".join(filter(None, changes)) or None
        return position

    def start_outputs(
        self,
        config: Config,
        session: distributed.Session,
        said: list[str],
        step: int,
        epoch: int,
        steps_per_epoch: int,
        total_steps: int,
    ) -> Monitor:
        """Rank 0 writes config.toml (the config this run follows: `config`) and, continuing a checkpoint,
        drops what an interrupted run logged after it; then every rank opens its monitor, which says
        `said` (how the run starts), which attempt this is, and what changed since the checkpoint."""
        run_dir, is_main = self.run_dir, session.is_main
        continuing = self.resumed_from is not None and step < total_steps
        # A finished run rerun trains nothing and writes nothing: its config.toml stays the one that trained it,
        # no tracker or event file is opened, and its weights are kept (written only where they are missing).
        complete = self.resumed_from is not None and not continuing
        logged_past = evaluated = weights = False  # the interrupted run logged after the checkpoint: new tracker runs
        if is_main:
            header = rundir.config_header(given_in_code=not self.described_by_config)
            if not complete:
                atomic_write_text(run_dir / "config.toml", header + config.to_toml())
            weights = (run_dir / "model.safetensors").is_file()
            if continuing:
                # An epoch that ended exactly at the checkpoint is evaluated on resume, as is a step
                # training.eval_every_steps evaluates (see Evaluator.should_evaluate) — unless that
                # evaluation was logged already: it evaluated the very weights of the checkpoint.
                every = config.training.eval_every_steps
                due = step == (epoch + 1) * steps_per_epoch or (every > 0 and step > 0 and step % every == 0)
                evaluated = due and evaluated_at(run_dir / "metrics.jsonl", step)
                logged_past = truncate_metrics(run_dir / "metrics.jsonl", step, drop_eval_at_step=due and not evaluated)
        if continuing:
            self.evaluated_at_resume = bool(distributed.from_rank0(evaluated))
        if complete:
            self.weights_kept = bool(distributed.from_rank0(weights))
        trackers = () if complete else config.monitor.trackers
        monitor = Monitor(
            run_dir,
            is_main,
            total_steps,
            step,
            purge_after=step if continuing else None,
            trackers=trackers,
            config=config.to_dict(),
            logged_past=logged_past,
        )
        others = [t for t in trackers if t != "tensorboard"]
        restarted = restart_line(others, step) if logged_past and others else None
        attempt = distributed.describe_attempt(session.world_size)
        for line in (*said, attempt, *self.lines(step, steps_per_epoch, total_steps), restarted):
            if line:
                monitor.info(line)
        return monitor

    def lines(self, step: int, steps_per_epoch: int, total_steps: int) -> list[str]:
        """What the console says about the resume: where from, and what changed (if it trains on)."""
        if self.resumed_from is None:
            return []
        continuing = step < total_steps
        epochs = f"epoch {epoch_of(step, steps_per_epoch)} of {epoch_of(total_steps, steps_per_epoch)}"
        said = [
            f"resumed from {self.resumed_from.path} (step {step} of {total_steps}, {epochs})"
            + ("" if continuing else f": the run is already complete; {NOTHING_TO_TRAIN}")
        ]
        if self.regrouped and continuing:
            said.append(self.regrouped)
        if self.replanned and continuing:
            said.append(
                f"the config changed since that checkpoint ({self.replanned}): this run follows it from "
                f"step {step}" + (", the learning-rate schedule rebuilt for its plan" if self.rescheduled else "")
            )
        return said


def check_stateful(parts: dict[str, Any], set_up: bool) -> None:
    """Refuse a part to checkpoint that cannot save and load its state (torch's Stateful protocol), or
    one registered once the run is `set_up` (and has resumed already)."""
    if set_up:
        raise DtrainError(
            "register_for_checkpointing() after setup(): the run has resumed already; register before setup() or fit()"
        )
    for name, part in parts.items():
        if not name.isidentifier() or name in BUILT_IN_PARTS or name in HEADER:
            raise DtrainError(
                f"register_for_checkpointing({name!r}=...): a part's name is a plain identifier (no dots: the "
                f"checkpoint's tensors are named <part>.<key>) and not one a checkpoint uses itself "
                f"({', '.join(BUILT_IN_PARTS)}, step, epoch, ...); choose another name"
            )
        if isinstance(part, type):
            raise DtrainError(
                f"register_for_checkpointing({name}=...) got the class {part.__name__}, not an object of it; "
                f"pass the instance whose state to keep"
            )
        if not (callable(getattr(part, "state_dict", None)) and callable(getattr(part, "load_state_dict", None))):
            raise DtrainError(
                f"register_for_checkpointing({name}=...) needs an object with state_dict() and "
                f"load_state_dict(); {type(part).__name__} has not both"
            )


def identity(config: Config, train_samples: int | str) -> dict[str, Any]:
    """What a checkpoint must share with this run to be resumed by it at all."""
    return {
        "optimizer.name": config.optimizer.key,
        "run.seed": config.run.seed,
        "data.name": config.data.name,
        "training samples": train_samples,
        # A LoRA checkpoint holds only the adapters: they mean something on their base, with their settings.
        **(
            {"training.lora": config.training.lora, "lora base": lora.base_reference(config)}
            if config.training.lora
            else {}
        ),
    }


def plan(config: Config, total_steps: int, steps_per_epoch: int) -> dict[str, int]:
    """What this run plans, kept in its checkpoints: a rerun planning the same has nothing left to train
    once a checkpoint reached `total_steps` (see rundir.resume_point.finished)."""
    return {
        "training.epochs": config.training.epochs,
        "training.max_steps": config.training.max_steps,
        "steps": total_steps,
        "steps_per_epoch": steps_per_epoch,
    }


def spread(config: Config) -> dict[str, Any]:
    """How the run is spread and computed: may change on resume, and the console says so (see restore)."""
    return {
        "parallel.strategy": config.parallel.strategy,
        "parallel.tp_size": config.parallel.tp_size,  # the layout: checkpoints resume under any
        "parallel.pp_size": config.parallel.pp_size,
        "parallel.cp_size": config.parallel.cp_size,
        "training.compile": config.training.compile,
        "training.activation_checkpointing": config.training.activation_checkpointing,
        "training.precision": config.training.precision,
        "data.sampling": config.data.sampling,  # which windows the steps after the resume draw
        "data.packing": config.data.packing,
    }


def unschedule(scheduler: torch.optim.lr_scheduler.LRScheduler | Schedule, skipped: int) -> None:
    """Take the steps GradScaler skipped back out of the LR schedule, so that it follows the
    optimizer's real updates (warm-up is not spent on steps that changed nothing). Every rank
    does it at the same log step, with the same count."""
    if isinstance(scheduler, Schedule):
        scheduler.rewind(skipped)
        return
    scheduler.last_epoch -= skipped + 1
    scheduler.step()  # recomputes every group's lr at the corrected position (a closed-form schedule's)


def follow_the_configs_optimizer(optimizer: torch.optim.Optimizer, wanted: list[dict[str, Any]]) -> str | None:
    """The config's optimizer settings (momentum, weight decay, betas, …, group by group) over the
    checkpoint's, which loading its state brought back. What changed, or None."""
    restored = _settings(optimizer, ())
    changes: dict[str, None] = {}  # in order, each once
    for group, before, now in zip(optimizer.param_groups, restored, wanted):
        for key, value in now.items():
            if key not in _IMPLEMENTATION and _plain(before.get(key)) != _plain(value):
                changes[f"optimizer.{key} {_plain(before.get(key))} → {_plain(value)}"] = None
        group.update(now)
    return ", ".join(changes) or None


def _settings(optimizer: torch.optim.Optimizer, driven: tuple[str, ...]) -> list[dict[str, Any]]:
    """Each group's settings, less those the schedule sets (`driven`)."""
    skip = (*_NOT_SETTINGS, *driven)
    return [{k: v for k, v in group.items() if k not in skip} for group in optimizer.param_groups]


def _plain(value: Any) -> Any:
    """A setting as the config writes it (a checkpoint's JSON makes betas a list)."""
    return list(value) if isinstance(value, tuple) else value


def batch_stream(batches: Batches, step: int) -> Iterator[list[Any]]:
    """Every step's micro-batches from `step` (the run's position) on: see TrainBatches.stream (epochs
    in their orders) and StreamBatches.stream (an iterable set from its checkpointed position)."""
    yield from batches.stream(step)
