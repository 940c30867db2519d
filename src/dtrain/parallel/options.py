"""What each part of parallel/ reads, built once from the config: small frozen objects, so that a strategy's
signature says what it depends on (as torchtitan hands each component its own slice of the config).
The package's front (parallel/__init__.py) reads the config; the strategies read only these."""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.config import Config, DDPConfig


@dataclass(frozen=True)
class BlockOptions:
    """What is done block by block (blocks.py): which modules are the blocks, and how each is
    checkpointed and compiled."""

    names: tuple[str, ...] = ()  # model.blocks: the block classes by name (empty: the model's own)
    activation_checkpointing: str = "none"  # training.activation_checkpointing
    compile: str = "none"  # training.compile


@dataclass(frozen=True)
class FSDPOptions:
    """How FSDP2 shards the blocks and the rest of the model (fsdp.py)."""

    reshard_after_forward: bool = True
    cpu_offload: bool = False
    precision: str = "fp32"  # training.precision: bf16 gathers and computes in bf16, reduces in fp32


@dataclass(frozen=True)
class PipelineOptions:
    """How the pipeline cuts the blocks into stages and runs them (pipeline.py, stages.py)."""

    schedule: str = "1f1b"
    stages_per_rank: int = 1
    split: str = "cost"


@dataclass(frozen=True)
class StrategyOptions:
    """Everything `parallel.build` reads: the strategy, and each part's own options."""

    strategy: str = "ddp"
    blocks: BlockOptions = BlockOptions()
    fsdp: FSDPOptions = FSDPOptions()
    pipeline: PipelineOptions = PipelineOptions()
    ddp: DDPConfig | None = None  # DDP's own section (None: its defaults)
    timeout_s: float = 1800.0  # distributed.timeout_s: the shared-memory average waits as long as a collective
    breakdown: bool = False  # monitor.breakdown: the communication timed apart from the compute
    weights_given: bool = False  # model.init_from or a folder's weights fill a model built on the meta device

    @property
    def sharded(self) -> bool:
        """Whether the strategy shards parameters, gradients and optimizer state."""
        return self.strategy in SHARDED

    @classmethod
    def of(cls, config: Config) -> StrategyOptions:
        par, training = config.parallel, config.training
        return cls(
            strategy=par.strategy,
            blocks=BlockOptions(tuple(config.model.blocks), training.activation_checkpointing, training.compile),
            fsdp=FSDPOptions(par.reshard_after_forward, par.fsdp_cpu_offload, training.precision),
            pipeline=PipelineOptions(par.pp_schedule, par.stages_per_rank, par.pp_split),
            ddp=config.ddp,
            timeout_s=config.distributed.timeout_s,
            breakdown=config.monitor.breakdown,
            weights_given=config.model.weights is not None,
        )


SHARDED = ("fsdp", "hsdp")  # the strategies whose processes hold shards of the state
