"""The degrees of parallelism a job runs with, named and validated together (as torchtitan's
`ParallelDims`): a strategy is a composition of these dimensions, not a class per combination.

    dp_replicate  copies of the model that average their gradients (DDP; HSDP across its groups)
    dp_shard      processes the parameters, gradients and optimizer state are sharded over (FSDP;
                  HSDP within a group)
    tp, pp        tensor and pipeline parallel: present, at degree 1, for the mesh they will join

Their product is the world size. `distributed.strategy` says which dimensions the processes fill.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from dtrain.config import Config
from dtrain.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

_NOT_YET = {"tp": "tensor parallel", "pp": "pipeline parallel"}


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            degree = getattr(self, f.name)
            if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
                raise ConfigError(f"the {f.name} degree of parallelism must be a whole number >= 1; got {degree!r}")
        for name, what in _NOT_YET.items():
            if getattr(self, name) > 1:
                raise ConfigError(
                    f"{what} ({name} = {getattr(self, name)}) is not yet supported: dtrain spreads data only; "
                    f"use {name} = 1"
                )

    @classmethod
    def from_config(cls, config: Config, world_size: int, local_world_size: int) -> ParallelDims:
        """The dimensions `distributed.strategy` fills with `world_size` processes, `local_world_size`
        per node; refused in one line when they cannot."""
        dc = config.distributed
        if dc.strategy == "fsdp":
            return cls(dp_shard=world_size)
        if dc.strategy == "hsdp":
            shard = dc.hsdp_shard_size or local_world_size
            if world_size % shard:
                raise ConfigError(
                    f"distributed.strategy = 'hsdp' shards over groups of {shard} processes "
                    f"(distributed.hsdp_shard_size, default: the processes of one node) and {world_size} "
                    f"processes do not divide into them; set distributed.hsdp_shard_size to a divisor of "
                    f"{world_size}"
                )
            return cls(dp_replicate=world_size // shard, dp_shard=shard)
        return cls(dp_replicate=world_size)

    @property
    def world_size(self) -> int:
        return math.prod(getattr(self, f.name) for f in fields(self))

    def dp_mesh(self, device_type: str) -> DeviceMesh:
        """The data-parallel device mesh a sharded strategy spreads the model over: one dimension of
        shards, or (replicate, shard) when there are copies too, the shard groups being consecutive
        ranks (one node's, by default)."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.dp_replicate == 1:
            return init_device_mesh(device_type, (self.dp_shard,))
        return init_device_mesh(device_type, (self.dp_replicate, self.dp_shard), mesh_dim_names=("replicate", "shard"))
