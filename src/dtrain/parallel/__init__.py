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


def layout(config: Config, session: Session) -> ParallelDims:
    """The job's dimensions of parallelism for this session's processes (checked by the launcher first)."""
    return ParallelDims.from_config(config, session.world_size, session.env.local_world_size)


def data_ranks(config: Config, world_size: int, local_world_size: int) -> int:
    """The processes of a `world_size` job that draw distinct samples: the world over the model's splits
    (tensor, pipeline, context parallel); a layout that does not factor is refused by check_sharding."""
    dc = config.distributed
    return max(1, world_size // (dc.tp_size * dc.pp_size * dc.cp_size))


def build(
    config: Config, session: Session, module: nn.Module, observer: CommObserver, dims: ParallelDims | None = None
) -> Strategy:
    """Spread `module` (already on its device; its buffers only, where its parameters are on the meta
    device) as `distributed.strategy` says; `observer` (the step timer) hears of the gradient communication."""
    problem = check_sharding(config, session.world_size, session.env.local_world_size, session.device.type)
    if problem:
        raise ConfigError(problem)
    sharded = shards_state(config)
    deferred.check(module, config, sharded=sharded and session.world_size > 1)
    if config.distributed.pp_size > 1:  # split first: checkpointing and compile then wrap the stage's blocks
        from dtrain.parallel.pipeline import Pipeline

        return Pipeline(module, session, dims or layout(config, session), config, observer)
    units = blocks.apply_block_options(module, config, session.device, sharded=sharded, quiet=session.rank != 0)
    if session.world_size == 1:  # nothing to spread: every strategy is the module itself
        return Strategy(module)
    dims = dims or layout(config, session)
    strategy: Strategy
    if sharded:
        from dtrain.parallel.fsdp import FSDP

        strategy = FSDP(module, session, dims, config, units)
    else:
        from dtrain.parallel.ddp import DDP

        strategy = DDP(module, session, dims, config.distributed, observer, breakdown=config.monitor.breakdown)
    if dims.cp > 1:  # sequences split over the "cp" processes; their gradients averaged with the data's
        from dtrain.parallel.context import ContextParallel

        strategy.sequence_split = ContextParallel(module, dims.world_mesh(session.device.type)["cp"])
    return strategy


def check_sharding(config: Config, world_size: int, local_world_size: int, device_type: str = "cpu") -> str | None:
    """What the strategy and the model-splitting sizes cannot do with this config and world (the launcher
    checks it before any worker starts), or None."""
    dc, name = config.distributed, config.distributed.strategy
    try:  # the processes must fill every dimension (hsdp: whole shard groups; tp within a node)
        dims = ParallelDims.from_config(config, world_size, local_world_size)
    except ConfigError as exc:
        return str(exc)
    if dims.cp > 1 and device_type != "cuda":
        return (
            f"distributed.cp_size = {dims.cp}: context parallel splits attention over CUDA GPUs "
            f"(torch's context_parallel has no rule for it on the {device_type}); set distributed.cp_size=1"
        )
    if dims.cp > 1 and config.data.packing:
        return (
            f"distributed.cp_size = {dims.cp} runs causal ring attention, and data.packing = true needs a "
            f"mask per document it cannot take; set data.packing=false or distributed.cp_size=1"
        )
    for size, what in ((dims.tp, "tp_size"),):
        if size > 1:  # each lands with its own strategy
            return f"distributed.{what} = {size} is not supported yet; set distributed.{what}=1"
    if dims.pp > 1:
        return pipeline_problem(config, dims)
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
    return None


def pipeline_problem(config: Config, dims: ParallelDims) -> str | None:
    """What pipeline parallel (`distributed.pp_size > 1`) cannot do with this config, or None. The model's
    depth is checked where the model is known (pipeline.check_model)."""
    tc = config.training
    if dims.dp_shard > 1:
        return (
            f"distributed.pp_size = {dims.pp} with distributed.strategy = '{config.distributed.strategy}': "
            f"sharding inside pipeline stages is not built yet; use distributed.strategy=ddp (each stage "
            f"replicated over the {dims.dp} data-parallel processes)"
        )
    if tc.grad_accum_steps < dims.pp:
        return (
            f"training.grad_accum_steps = {tc.grad_accum_steps}: the pipeline's micro-batches are the "
            f"accumulation micro-batches and {dims.pp} stages need at least {dims.pp}; set "
            f"training.grad_accum_steps >= {dims.pp}"
        )
    if tc.precision == "fp16":
        return "training.precision = 'fp16' is not supported with distributed.pp_size > 1; use training.precision=bf16"
    if config.model.weights is not None:  # read into the whole model's names: each stage's, not built yet
        return (
            "distributed.pp_size > 1 with weights to start from (model.init_from, a Hugging Face folder) is "
            "not supported yet; start the pipeline from a new model, or set distributed.pp_size=1"
        )
    if tc.compile == "model":
        return (
            "training.compile = 'model' compiles the whole forward, and a pipeline stage runs part of it; "
            "use training.compile=blocks"
        )
    return None
