"""How a model is spread over the processes: `distributed.strategy`, one small interface (base.py).

    ddp   every process holds the whole model, gradients averaged in backward (ddp.py)
    fsdp  parameters, gradients and optimizer state sharded over every process (fsdp.py, FSDP2)
    hsdp  sharded within a group of processes (a node), replicated across the groups (fsdp.py)

The trainer asks a strategy for the model to call, to skip gradient sync on accumulation
micro-batches, to clip by the global norm and for the full weights at the end; checkpoints read the
module's own state dict (DTensor shards under FSDP), which torch.distributed.checkpoint writes as is.
Before any strategy, blocks.py checkpoints activations and compiles, block by block. A strategy
is handed the job's dimensions of parallelism (dims.py: data replicated, data sharded) and a narrow
observer of its communication (observer.py) that the step timer satisfies.
"""

from __future__ import annotations

from torch import nn

from dtrain.config import Config
from dtrain.distributed import Session
from dtrain.errors import ConfigError
from dtrain.parallel import blocks, deferred
from dtrain.parallel.base import Strategy
from dtrain.parallel.deferred import to_device as to_device
from dtrain.parallel.dims import ParallelDims
from dtrain.parallel.observer import CommObserver

SHARDED = ("fsdp", "hsdp")  # the strategies whose processes hold shards of the state


def shards_state(config: Config) -> bool:
    """Whether `distributed.strategy` shards parameters, gradients and optimizer state (before the
    strategy exists: a built one says so itself, `Strategy.shards_state`)."""
    return config.distributed.strategy in SHARDED


def builds_on_meta(config: Config, world_size: int) -> bool:
    """Whether the worker builds the model with its parameters on the meta device (deferred.py): when a
    sharding strategy spreads it over processes and a file's weights fill it. Not under LoRA: the base
    weights are read before the adapters go in, into the whole model (models/lora.py)."""
    return shards_state(config) and world_size > 1 and config.model.weights is not None and not config.training.lora


def build(config: Config, session: Session, module: nn.Module, observer: CommObserver) -> Strategy:
    """Spread `module` (already on its device; its buffers only, where its parameters are on the meta
    device) as `distributed.strategy` says; `observer` (the step timer) hears of the gradient communication."""
    problem = check_sharding(config, session.world_size, session.env.local_world_size)
    if problem:
        raise ConfigError(problem)
    sharded = shards_state(config)
    deferred.check(module, config, sharded=sharded and session.world_size > 1)
    units = blocks.apply_block_options(module, config, session.device, sharded=sharded, quiet=session.rank != 0)
    if session.world_size == 1:  # nothing to spread: every strategy is the module itself
        return Strategy(module)
    dims = ParallelDims.from_config(config, session.world_size, session.env.local_world_size)
    if sharded:
        from dtrain.parallel.fsdp import FSDP

        return FSDP(module, session, dims, config, units)
    from dtrain.parallel.ddp import DDP

    return DDP(module, session, dims, config.distributed, observer, breakdown=config.monitor.breakdown)


def check_sharding(config: Config, world_size: int, local_world_size: int) -> str | None:
    """What a sharded strategy cannot do with this config and world (the launcher checks it before any
    worker starts), or None."""
    dc, name = config.distributed, config.distributed.strategy
    if name not in SHARDED:
        return None
    if config.training.precision == "fp16":
        return (
            f"training.precision = 'fp16' needs a gradient scaler that knows the shards, which dtrain "
            f"has only for distributed.strategy = 'ddp'; use training.precision=bf16 with '{name}'"
        )
    if dc.comm_hook != "none":
        return (
            f"distributed.comm_hook = '{dc.comm_hook}' is a DDP hook; distributed.strategy = '{name}' "
            f"reduces gradients itself: set distributed.comm_hook=none"
        )
    try:  # the processes must fill the strategy's dimensions (hsdp: whole shard groups)
        ParallelDims.from_config(config, world_size, local_world_size)
    except ConfigError as exc:
        return str(exc)
    return None
