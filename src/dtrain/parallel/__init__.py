"""How a model is spread over the processes: `parallel.strategy`, one small interface (base.py).

    ddp   every process holds the whole model, gradients averaged in backward (ddp.py)
    fsdp  parameters, gradients and optimizer state sharded over every process (fsdp.py, FSDP2)
    hsdp  sharded within a group of processes (a node), replicated across the groups (fsdp.py)

`parallel.tp_size` splits each layer over that many processes first (tensor.py), FSDP then shards
over the data dimensions; with `ddp` the tensor-parallel processes must be the whole world (one copy).

The trainer asks a strategy for the model to call, to skip gradient sync on accumulation
micro-batches, to clip by the global norm and for the full weights at the end; checkpoints read the
module's own state dict (DTensor shards under FSDP), which torch.distributed.checkpoint writes as is.
Before any strategy, blocks.py checkpoints activations and compiles, block by block. A strategy
is handed the job's dimensions of parallelism (dims.py: data replicated, data sharded) and a narrow
observer of its communication (observer.py) that the step timer satisfies.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from torch import nn

from dtrain.config import Config, DDPConfig
from dtrain.distributed import Session
from dtrain.errors import ConfigError
from dtrain.parallel import blocks, deferred
from dtrain.parallel.base import Strategy
from dtrain.parallel.deferred import to_device as to_device
from dtrain.parallel.dims import ParallelDims, TpProblem, tp_sizes
from dtrain.parallel.observer import CommObserver
from dtrain.parallel.options import SHARDED, StrategyOptions


def shards_state(config: Config) -> bool:
    """Whether `parallel.strategy` shards parameters, gradients and optimizer state (before the
    strategy exists: a built one says so itself, `Strategy.shards_state`)."""
    return config.parallel.strategy in SHARDED


def builds_on_meta(config: Config, world_size: int) -> bool:
    """Whether the worker builds the model with its parameters on the meta device (deferred.py): when a
    sharding strategy spreads it over processes and a file's weights fill it. Not under LoRA: the base
    weights are read before the adapters go in, into the whole model (models/lora.py)."""
    return shards_state(config) and world_size > 1 and config.model.weights is not None and not config.training.lora


def layout(config: Config, session: Session) -> ParallelDims:
    """The job's dimensions of parallelism for this session's processes, built once (the trainer hands
    them on), the config checked against them first (as the launcher does: a Trainer in a script of its
    own has no launcher)."""
    problem = check_sharding(config, session.world_size, session.env.local_world_size, session.device.type)
    if problem:
        raise ConfigError(problem)
    return ParallelDims.from_config(config.parallel, session.world_size, session.env.local_world_size)


def data_ranks(config: Config, world_size: int, local_world_size: int) -> int:
    """The processes of a `world_size` job that draw distinct samples: the world over the model's splits
    (tensor, pipeline, context parallel); a layout that does not factor is refused by check_sharding."""
    dc = config.parallel
    return max(1, world_size // (dc.tp_size * dc.pp_size * dc.cp_size))


def build(
    options: StrategyOptions,
    session: Session,
    module: nn.Module,
    observer: CommObserver,
    dims: ParallelDims,
    tp_plan: Mapping[str, Any] | None = None,
    default_loss: bool = False,
) -> Strategy:
    """Spread `module` (already on its device; its buffers only, where its parameters are on the meta
    device) over `dims` (`layout`) as `options` say; `observer` (the step timer) hears of the gradient
    communication. In torchtitan's order: tensor parallel (by `tp_plan`, else the model's), then
    activation checkpointing and compile per block, then FSDP over the data dimensions. `default_loss`:
    the step's loss is dtrain's cross-entropy, so the model's logits may stay split (loss parallel)."""
    sharded = options.sharded
    deferred.check(module, sharded and session.world_size > 1, options.weights_given)
    if dims.pp > 1:  # split first: checkpointing and compile then wrap the stage's blocks
        from dtrain.parallel.pipeline import Pipeline

        return Pipeline(module, session, dims, options, observer, tp_plan)
    split_logits = False
    if dims.tp > 1:
        from dtrain.parallel import dropout, tensor

        tp_mesh = dims.world_mesh(session.device.type)["tp"]
        split_logits = tensor.parallelize(module, tp_mesh, tp_plan, loss_parallel=default_loss)
        if tp_plan is None:  # the model's own plan: it knows where its dropout acts
            dropout.own_streams(module, dims.coordinate(session.rank)["tp"])
    units = blocks.apply_block_options(module, options.blocks, session.device, sharded=sharded, quiet=session.rank != 0)
    if session.world_size == 1:  # nothing to spread: every strategy is the module itself
        return Strategy(module)
    strategy: Strategy
    if dims.tp > 1 and dims.dp == 1:  # no data-parallel copies: the shards are the whole spreading
        from dtrain.parallel.tensor import TensorParallel

        deferred.materialise(module, session.device)
        strategy = TensorParallel(module, dims)
    elif sharded:
        from dtrain.parallel.fsdp import FSDP

        strategy = FSDP(module, session, dims, options.fsdp, units)
    else:
        from dtrain.parallel.ddp import DDP

        ddp_options = options.ddp or DDPConfig()
        strategy = DDP(module, session, dims, ddp_options, options.timeout_s, observer, options.breakdown)
    if dims.cp > 1:  # sequences split over the "cp" processes; their gradients averaged with the data's
        from dtrain.parallel.context import ContextParallel

        strategy.sequence_split = ContextParallel(module, dims.world_mesh(session.device.type)["cp"])
    strategy.split_logits = split_logits
    return strategy


def model_problem(
    config: Config, module: nn.Module, tp_plan: Mapping[str, Any] | None = None, world: tuple[int, int] | None = None
) -> str | None:
    """What the sizes cannot split `module` into (it may be on the meta device: the launcher checks the
    built-in models so, before any worker starts), or None. `world`: (processes, processes per node), so
    that a refusal offers only tensor-parallel sizes that also factor it."""
    from dtrain.parallel import tensor

    if config.parallel.pp_size > 1:  # enough blocks for the stages (raises)
        from dtrain.parallel.stages import check_model

        check_model(module, config.model.blocks, config.parallel.pp_size, config.parallel.stages_per_rank)
    sizes = tp_sizes(config.parallel, *world) if world is not None else None
    return tensor.problem(module, config.parallel.tp_size, tp_plan, _window(config), sizes)


def tp_problem(config: Config, module: nn.Module, tp: int, sizes: Collection[int] | None = None) -> str | None:
    """Why `tp` tensor-parallel processes cannot split `module` (its heads, width, windows), offering sizes
    of `sizes` where given; None where they can."""
    from dtrain.parallel import tensor

    return tensor.problem(module, tp, None, _window(config), sizes)


def _window(config: Config) -> int | None:
    """The window sequence parallel splits over the tensor-parallel processes, where the data says it."""
    return config.data.block_size if config.data.name == "tokens" else None


def check_sharding(
    config: Config,
    world_size: int,
    local_world_size: int,
    device_type: str = "cpu",
    model_tp_problem: TpProblem | None = None,
) -> str | None:
    """What the strategy and the model-splitting sizes cannot do with this config and world (the launcher
    checks it before any worker starts), or None. `model_tp_problem`: the model's own reason a tp size
    cannot split it (see ParallelDims.from_config)."""
    name = config.parallel.strategy
    try:  # the processes must fill every dimension (hsdp: whole shard groups; tp within a node)
        dims = ParallelDims.from_config(config.parallel, world_size, local_world_size, model_tp_problem)
    except ConfigError as exc:
        return str(exc)
    if dims.cp > 1 and device_type != "cuda":
        return (
            f"parallel.cp_size = {dims.cp}: context parallel splits attention over CUDA GPUs "
            f"(torch's context_parallel has no rule for it on the {device_type}); set parallel.cp_size=1"
        )
    if dims.cp > 1 and config.data.packing:
        return (
            f"parallel.cp_size = {dims.cp} runs causal ring attention, and data.packing = true needs a "
            f"mask per document it cannot take; set data.packing=false or parallel.cp_size=1"
        )
    if dims.tp > 1 and name == "ddp" and dims.dp > 1 and dims.pp == 1:  # the pipeline averages its copies
        return (
            f"parallel.strategy = 'ddp' keeps whole copies of the model and parallel.tp_size = {dims.tp} "
            f"splits it ({dims.dp} copies over {world_size} processes): DDP cannot average tensor-parallel "
            f"shards; set parallel.strategy=fsdp (or hsdp) to spread the copies"
        )
    if dims.tp > 1 and config.training.precision == "fp16":
        return (
            f"training.precision = 'fp16' needs a gradient scaler that knows tensor-parallel shards "
            f"(parallel.tp_size = {dims.tp}); use training.precision=bf16"
        )
    if dims.pp > 1:
        return pipeline_problem(config, dims)
    if name not in SHARDED:
        return None
    if config.training.precision == "fp16":
        return (
            f"training.precision = 'fp16' needs a gradient scaler that knows the shards, which dtrain "
            f"has only for parallel.strategy = 'ddp'; use training.precision=bf16 with '{name}'"
        )
    if config.ddp.comm_hook != "none":
        return (
            f"ddp.comm_hook = '{config.ddp.comm_hook}' is a DDP hook; parallel.strategy = '{name}' "
            f"reduces gradients itself: set ddp.comm_hook=none"
        )
    return None


def pipeline_problem(config: Config, dims: ParallelDims) -> str | None:
    """What pipeline parallel (`parallel.pp_size > 1`) cannot do with this config, or None. The model's
    depth is checked where the model is known (stages.check_model)."""
    tc = config.training
    if config.model.hf_folder is not None:  # its forward runs every block: a stage's absent ones break it
        return (
            f"parallel.pp_size = {dims.pp} with model.name = '{config.model.name}': a Hugging Face model's "
            f"forward does not pass over the blocks a pipeline stage lacks; set parallel.pp_size=1"
        )
    if dims.dp_shard > 1 and config.parallel.stages_per_rank > 1:
        return (
            f"parallel.pp_schedule = 'interleaved_1f1b' holds {config.parallel.stages_per_rank} stages per "
            f"process, and parallel.strategy = '{config.parallel.strategy}' shards one stage per process; "
            f"use parallel.pp_schedule=1f1b (or gpipe), or parallel.strategy=ddp"
        )
    if tc.grad_accum_steps < dims.pp:
        return (
            f"training.grad_accum_steps = {tc.grad_accum_steps}: the pipeline's micro-batches are the "
            f"accumulation micro-batches and {dims.pp} stages need at least {dims.pp}; set "
            f"training.grad_accum_steps >= {dims.pp}"
        )
    if tc.precision == "fp16":
        return "training.precision = 'fp16' is not supported with parallel.pp_size > 1; use training.precision=bf16"
    if config.model.weights is not None:  # read into the whole model's names: each stage's, not built yet
        return (
            "parallel.pp_size > 1 with weights to start from (model.init_from, a Hugging Face folder) is "
            "not supported yet; start the pipeline from a new model, or set parallel.pp_size=1"
        )
    if tc.compile == "model":
        return (
            "training.compile = 'model' compiles the whole forward, and a pipeline stage runs part of it; "
            "use training.compile=blocks"
        )
    return None
