"""What a checkpoint describes: where training stands and which live objects it captures.

The heavy lifting (torch.distributed.checkpoint) lives in `tensors.py`, imported only when a
checkpoint is actually written or read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dtrain.checkpoint.store import CheckpointError
from dtrain.parallel.base import StageNames

# What a rerun of a finished run is told.
NOTHING_TO_TRAIN = "nothing to train — raise training.epochs or training.max_steps to train on"


def epoch_of(step: int, steps_per_epoch: int) -> int:
    """The epoch (counted from 1) that optimizer step `step` (counted from 1) belongs to: what every
    console line and metrics record says, so a train line, an eval line and a resume line at the same
    step agree (a 2-epoch run ends at "epoch 2" everywhere)."""
    return max(1, -(-step // max(1, steps_per_epoch)))


@dataclass
class Position:
    """Where training stands: `step` optimizer steps done, `step - epoch * steps_per_epoch` of them in
    the current epoch."""

    step: int
    epoch: int
    # fp16: steps GradScaler skipped that the LR schedule has not yet taken back (it does so at log
    # steps); a resume must take them back at the same log step as the run it continues.
    unscheduled_skips: int = 0
    # How the checkpoint's run was spread and compiled (Parts.setup), for the resume to say what changed.
    setup: dict[str, Any] = field(default_factory=dict)
    # What the resume has to say about the checkpoint's parts (one it lacks, one nobody registered).
    notes: list[str] = field(default_factory=list)


# The parts every checkpoint holds (checkpoint/parts.py), and the trainer.json keys of its header: no
# registered part may take either name.
BUILT_IN_PARTS = ("model", "optimizer", "scheduler", "scaler", "rng")
HEADER = (
    "format",
    "step",
    "epoch",
    "world_size",
    "data_ranks",
    "samples_per_step",
    "identity",
    "unscheduled_skips",
    "setup",
    "plan",
    "parts",
)


@dataclass
class Parts:
    """The live objects a checkpoint captures."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any  # an LRScheduler, or the train package's Schedule around one: state_dict / load_state_dict
    scaler: torch.amp.GradScaler
    rank: int
    world_size: int
    samples_per_step: int  # per rank: data.batch_size × training.grad_accum_steps
    # What a resume must not change, by config key (optimizer.name, run.seed, the data): the state or
    # the position in the checkpoint means nothing under another. Compared on load.
    identity: dict[str, Any] = field(default_factory=dict)
    # What may change on resume and is said when it does (parallel.strategy, training.compile, ...).
    setup: dict[str, Any] = field(default_factory=dict)
    # The plan of the run writing the checkpoint (training.epochs, training.max_steps, its steps and steps
    # per epoch): a rerun asking the same of the checkpoint at its end has nothing to train (`finished`).
    plan: dict[str, int] = field(default_factory=dict)
    # Stateful objects registered by name (Trainer.register_for_checkpointing): saved and restored too.
    extra: dict[str, Any] = field(default_factory=dict)
    # The processes drawing distinct samples (the data-parallel ones; 0: every process): under tensor or
    # pipeline parallel a replica's processes share its samples, and the global batch is theirs × per rank.
    data_ranks: int = 0
    # Where `module` is a pipeline stage's part of the model: its place in the whole (the strategy's).
    stage: StageNames | None = None

    @property
    def data_world(self) -> int:
        return self.data_ranks or self.world_size

    def __post_init__(self) -> None:
        taken = sorted(set(self.extra) & {*BUILT_IN_PARTS, *HEADER})
        if taken:
            raise CheckpointError(
                f"register_for_checkpointing({taken[0]}=...): every checkpoint holds a '{taken[0]}' of its own; "
                f"register it under another name"
            )


def data_ranks_of(meta: dict[str, Any]) -> int:
    """The processes that drew distinct samples for checkpoint `meta` (before tensor and pipeline parallel,
    checkpoints did not say: every process did)."""
    return meta.get("data_ranks", meta.get("world_size", 1))


def identity_mismatch(name: str, saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    """Why checkpoint `name`, written under `saved`, cannot resume under `now`, or None. Keys absent from
    either side (an older checkpoint) are not compared."""
    saved = saved if isinstance(saved, dict) else {}
    changed = [key for key in now if key in saved and saved[key] != now[key]]
    if not changed:
        return None
    what = ", ".join(f"{key} = {saved[key]!r} there and {now[key]!r} here" for key in changed)
    keep = " ".join(f"{key}={saved[key]}" for key in changed if "." in key)
    return (
        f"checkpoint {name} was trained with {what}: "
        + _WHY.get(changed[0], "")
        + "resume with "
        + (f"{keep}, " if keep else "the same data, ")
        + "or start afresh (run.overwrite=true)"
    )


_WHY = {
    "optimizer.name": "its optimizer state does not carry over to another optimizer; ",
    "run.seed": "the data order of the epoch in progress depends on it; ",
    "data.name": "its position in the data means nothing in other data; ",
    "training samples": "its position in the data means nothing in other data; ",
    "training.lora": "it holds only adapters of those settings; ",
    "lora base": "it holds only adapters, trained on that base; ",
}


def world_size_mismatch(name: str, saved: int, now: int) -> str:
    return (
        f"checkpoint {name} was written by {saved} process{'es' if saved != 1 else ''} and this run has {now}; "
        f"resume with {saved} process{'es' if saved != 1 else ''} (--nproc × --nnodes): this data's order "
        f"(DistributedSampler's, or windows each process draws with data.sampling=random) depends on their number "
        f"(token data in windows, data.sampling=windows, resumes on any number), or start a new run.dir"
    )


def regroup(
    name: str,
    saved_world: int,
    saved_per_rank: int,
    world: int,
    batch_size: int,
    accum: int,
    global_order: bool | None,
    stated_global: int = 0,
) -> int:
    """The `training.grad_accum_steps` with which this run (`world` processes, `batch_size` each) resumes
    checkpoint `name` — taken by `saved_world` processes with `saved_per_rank` samples each per step —
    taking the same global batches; or a CheckpointError saying why it cannot.

    Whole accumulation steps must make up the checkpoint's global batch: usually `accum` itself; another
    where the batch size changed, or the checkpoint was itself taken after such a change (a run resumed
    on fewer processes, checkpointed, then rerun). At another world size only data served in a
    world-size-independent order (`global_order`: token data) can continue where it stood. `global_order`
    None: not known yet (the launcher, for a data factory): only the arithmetic is checked. A global batch
    the config states (`stated_global`, training.global_batch_size) must be the checkpoint's: it would
    otherwise be silently replaced by it."""
    if world != saved_world and global_order is False:
        raise CheckpointError(world_size_mismatch(name, saved_world, world))
    global_batch = saved_world * saved_per_rank
    if stated_global and stated_global != global_batch:
        raise CheckpointError(
            f"checkpoint {name} trained on global batches of {global_batch} samples and training.global_batch_size "
            f"= {stated_global}; a resume keeps the checkpoint's (the epoch in progress is ordered in them): give "
            f"training.global_batch_size={global_batch}, or start a new run.dir"
        )
    if global_batch % (batch_size * world):
        fits = [b for b in range(1, global_batch // world + 1) if global_batch % (b * world) == 0]
        raise CheckpointError(
            f"checkpoint {name} trained on global batches of {global_batch} samples ({processes(saved_world)} × "
            f"{saved_per_rank}); {processes(world)} with data.batch_size={batch_size} cannot make that up in "
            f"whole accumulation steps: "
            + (
                f"set data.batch_size to a divisor of {global_batch // world}, such as {', '.join(map(str, fits[-4:]))}"
                if fits
                else f"resume with a number of processes that divides {global_batch}"
            )
        )
    return global_batch // (batch_size * world)


def processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"
