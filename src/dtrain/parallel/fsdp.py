"""FSDP2 (`torch.distributed.fsdp.fully_shard`): parameters, gradients and optimizer state sharded.

Each transformer block (blocks.py says which modules are blocks) is its own unit, then the root: in
the forward pass a unit's parameters are gathered just before it runs and freed after it
(`parallel.reshard_after_forward`), and its gradients are reduce-scattered as backward leaves it.

One class over the data-parallel dimensions (dims.py): `fsdp` shards over every process, `hsdp` within
a group of `parallel.hsdp_shard_size` processes (default: one node) and replicates across the
groups, a 2-D device mesh (replicate, shard).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from dtrain.distributed import Session
from dtrain.errors import ConfigError
from dtrain.parallel import deferred
from dtrain.parallel.base import Strategy
from dtrain.parallel.blocks import check_unshared
from dtrain.parallel.dims import ParallelDims
from dtrain.parallel.dtensors import clip_grad_norm, gathered_state_dict
from dtrain.parallel.options import FSDPOptions

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class FSDP(Strategy):
    forward_is_collective = True
    shards_state = True
    comm_in_compute = True

    def __init__(
        self, module: nn.Module, session: Session, dims: ParallelDims, options: FSDPOptions, units: list[nn.Module]
    ):
        super().__init__(module, dims)
        self.mesh = dims.dp_mesh(session.device.type)
        shard(module, units, self.mesh, options, session.device)
        self.units = len(units)

    def sync_gradients(self, enabled: bool) -> None:
        # Off: backward keeps unsharded gradients and skips the reduce-scatter (and HSDP's all-reduce).
        cast(FSDPModule, self.module).set_requires_gradient_sync(enabled)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm(self.module, max_norm)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        return gathered_state_dict(self.module, self.mesh.get_rank() == 0)


def shard(
    module: nn.Module, units: list[nn.Module], mesh: DeviceMesh, options: FSDPOptions, device: torch.device
) -> None:
    """`fully_shard` each of `units` (the blocks), then `module` (what is left: embeddings, norm, head)
    over `mesh`; a model built on the meta device then gets memory for each rank's shards."""
    offload = OffloadPolicy()  # fully_shard's default: none
    if options.cpu_offload:
        if device.type != "cuda":
            raise ConfigError(
                "parallel.fsdp_cpu_offload moves GPU parameters and optimizer state to "
                "the CPU, and this job trains on the CPU already; set it to false"
            )
        offload = CPUOffloadPolicy(pin_memory=True)
    precision = _precision_policy(options.precision)
    check_unshared(module, units)
    for i, unit in enumerate(units):
        # The last block's parameters would be gathered again at once, backward starting where the
        # forward pass ended: they stay (as torchtitan does; FSDP2 treats the root alike).
        last = i == len(units) - 1
        reshard = options.reshard_after_forward and not last
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, mp_policy=precision, offload_policy=offload)
    fully_shard(
        module,
        mesh=mesh,
        reshard_after_forward=options.reshard_after_forward,
        mp_policy=precision,
        offload_policy=offload,
    )
    # A model built on the meta device: each rank's shards get memory now, where they live (the CPU
    # with offload), and the weights the run starts from fill them.
    deferred.materialise(module, torch.device("cpu") if options.cpu_offload else device)


def _precision_policy(precision: str) -> MixedPrecisionPolicy:
    """bf16: parameters gathered and computed in bf16, gradients reduced in fp32; fp32: all fp32."""
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()
