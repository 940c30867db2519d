"""What to say when training fails in a way the user can fix: out of memory, a diverged run.

Each answer is one line naming the settings that would help, only those that are not already set.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from dtrain import distributed, parallel
from dtrain.checkpoint.store import CheckpointStore
from dtrain.config import Config
from dtrain.errors import DtrainError


def check_trainable(module: object) -> None:
    """Refuse a model with nothing to train, before anything is built for it."""
    if not isinstance(module, nn.Module) or not any(p.requires_grad for p in module.parameters()):
        raise DtrainError(
            f"the model ({type(module).__name__}) has no trainable parameters: there is nothing to train; "
            f"give a torch.nn.Module with parameters that require gradients"
        )


def is_out_of_memory(exc: BaseException) -> bool:
    """A CUDA OOM, or the CPU allocator's (a MemoryError, or torch's RuntimeError saying so)."""
    return isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(exc)
    )


@contextlib.contextmanager
def out_of_memory_said(say: Callable[[BaseException], DtrainError]) -> Iterator[None]:
    """Raise `say(exc)`, the one-line advice, in place of running out of memory; anything else as it is."""
    try:
        yield
    except (torch.cuda.OutOfMemoryError, MemoryError, RuntimeError) as exc:
        if not is_out_of_memory(exc):
            raise
        raise say(exc) from None


def out_of_memory(
    when: str,
    exc: BaseException,
    config: Config,
    module: nn.Module,
    session: distributed.Session,
    grad_accum_steps: int,
    strategy: parallel.Strategy | None = None,
) -> DtrainError:
    """The one-line error for running out of memory `when` (at a step, while setting up), with the levers
    that are still off. `strategy`: the one built, if set-up got that far."""
    cfg, device = config, session.device
    batch, accum = cfg.data.batch_size, grad_accum_steps
    levers = [
        f"data.batch_size={max(1, batch // 2)} training.grad_accum_steps={accum * 2} (the same effective batch)"
        if batch > 1
        else "a smaller model"
    ]
    if cfg.training.precision == "fp32":
        levers.append("training.precision=bf16")
    if cfg.data.on_device and device.type == "cuda":
        levers.append("data.on_device=false")
    sharded = strategy.shards_state if strategy is not None else parallel.shards_state(cfg)
    if not sharded and session.world_size > 1:
        levers.append("parallel.strategy=fsdp (parameters, gradients and optimizer state sharded)")
    if cfg.training.activation_checkpointing == "none" and has_blocks(module, cfg):
        levers.append("training.activation_checkpointing=full")
    if sharded and not cfg.parallel.fsdp_cpu_offload and device.type == "cuda":
        levers.append("parallel.fsdp_cpu_offload=true")
    # Splitting the model itself, where it has the parts to split: a plan for its layers, blocks for stages.
    if session.world_size > 1 and cfg.parallel.tp_size == 1 and has_tensor_plan(module):
        levers.append("parallel.tp_size=2 (each layer's weights split over 2 processes of a node)")
    if session.world_size > 1 and cfg.parallel.pp_size == 1 and has_blocks(module, cfg):
        levers.append("parallel.pp_size=2 (the model's blocks split into 2 pipeline stages)")
    what = "GPU memory" if isinstance(exc, torch.cuda.OutOfMemoryError) else "memory"
    return DtrainError(
        f"out of {what} {when} on rank {session.rank} with "
        f"data.batch_size={batch} per process (training.grad_accum_steps={accum}, "
        f"training.precision={cfg.training.precision}); try {' or '.join(levers)}"
    )


def diverged(what: str, step: int, config: Config, store: CheckpointStore) -> DtrainError:
    """The error for a run that diverged by `step`: the levers, and the way back from the newest
    checkpoint in `store` (never a diverged state: see refuse_a_diverged_state)."""
    cfg, newest = config, store.newest()
    levers = [f"optimizer.lr={cfg.optimizer.lr / 10:g}"]
    if cfg.training.max_grad_norm <= 0:
        levers.append("training.max_grad_norm=1.0")
    if cfg.training.precision == "fp16":
        levers.append("training.precision=bf16")
    if newest is not None:
        again = (
            f"rerun with that change to resume from {newest.path} (step {newest.step}), or add "
            f"run.overwrite=true to start afresh"
        )
    else:
        again = "rerun with that change and run.overwrite=true to start afresh"
    return DtrainError(
        f"{what} by step {step}: training diverged and goes no further; try {' or '.join(levers)}: {again}"
    )


def refuse_a_diverged_loss(loss: float, step: int, config: Config, store: CheckpointStore) -> None:
    """Stop a run whose logged training loss is not finite (every rank has the same record: all stop
    here together), saying the levers and the way back."""
    if not math.isfinite(loss):
        raise diverged(f"the training loss became {loss}", step, config, store)


def refuse_a_diverged_state(module: nn.Module, step: int, config: Config, store: CheckpointStore) -> None:
    """Stop, on every rank, rather than write weights that are not finite (a checkpoint, the final
    weights): a loss can stay finite for the step whose update broke them."""
    broken = None if finite(module.parameters()) else diverged("the weights became nan or inf", step, config, store)
    distributed.every_rank_raises(None if broken is None else str(broken))


def finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every value of these tensors (this rank's shards) is finite: one host sync."""
    from torch.distributed.tensor import DTensor

    checks = [torch.isfinite(t.to_local() if isinstance(t, DTensor) else t).all() for t in tensors]
    return bool(torch.stack(checks).all()) if checks else True


def has_tensor_plan(module: nn.Module) -> bool:
    """Whether tensor parallel knows how to split `module`: the built-in GPT, or a Hugging Face model
    whose class or config carries its own plan."""
    from dtrain.models.gpt import GPT

    config = getattr(module, "config", None)
    return isinstance(module, GPT) or bool(
        getattr(module, "_tp_plan", None) or getattr(config, "base_model_tp_plan", None)
    )


def has_blocks(module: nn.Module, config: Config) -> bool:
    """Whether activation checkpointing could work on this model, block by block."""
    try:
        return bool(parallel.blocks.find_blocks(module, config.model.blocks))
    except DtrainError:
        return False
