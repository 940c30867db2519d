"""Context parallel (`parallel.cp_size`, CUDA GPUs only): each sequence split over the processes of
the mesh's "cp" dimension, attention computed as a ring over them.

Built with torch's own `context_parallel` (torch.distributed.tensor.experimental): inside it,
`scaled_dot_product_attention` is ring attention over the cp group, and the tensors it is handed are
sharded in place along their sequence dimension — balanced for causal attention (rank r of c keeps
chunks r and 2c−1−r of 2c) — and restored on exit. The step runs its micro-batches, forward and
backward, inside `ContextParallel.step`, which hands it:

- every (batch, positions) tensor of each micro-batch: token ids, targets, anything with the inputs'
  sequence length on dimension 1 (`sequence_tensors`);
- the model's positions (the built-in GPT's `sequence_positions`), so each token keeps its place in
  the whole sequence after the balancing reorders the chunks.

Gradients: the processes of one cp group hold the same samples and different tokens of them. The step
counts its target tokens inside the context, on the shards (train/loss.py `StepShares`), so summed
over every rank each token counts once and each rank's loss is its tokens' sum over the step's tokens;
the strategy then averages gradients over the data-parallel and the cp processes together (DDP: the
whole world; FSDP: shards over dp_shard × cp, torchtitan's `dp_shard_cp`, dims.py). The update is one
process's on the same batch. torch has no CPU rule for ring attention, so none of this runs on a CPU
(`parallel.check_sharding` refuses it there); `benchmarks/gpu_check.sh` compares it with one process
on a machine with 2+ GPUs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dtrain.errors import ConfigError, DtrainError
from dtrain.parallel.model_hooks import offered, set_sequence_positions

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def sequence_tensors(batch: Any) -> list[torch.Tensor]:
    """The tensors of `batch` (a tensor, tuple, list or dict, nested) to split along the sequence:
    integer or floating (batch, positions, ...) tensors whose dimension 1 is the first such tensor's
    (the inputs'); per-sample tensors (class labels, lengths) stay whole."""
    found: list[torch.Tensor] = []

    def walk(item: Any) -> None:
        if isinstance(item, torch.Tensor):
            if item.dim() >= 2 and (not found or item.shape[1] == found[0].shape[1]):
                found.append(item)
        elif isinstance(item, Mapping):
            for value in item.values():
                walk(value)
        elif isinstance(item, (tuple, list)):
            for value in item:
                walk(value)

    walk(batch)
    return found


def check_length(length: int, cp: int) -> str | None:
    """Why a sequence of `length` tokens cannot be split over `cp` processes, or None: the balanced
    split cuts it into 2·cp equal chunks."""
    if length % (2 * cp):
        return (
            f"parallel.cp_size = {cp} splits each sequence into {2 * cp} equal chunks and a sequence "
            f"of {length} tokens does not divide into them; set data.block_size to a multiple of {2 * cp}"
        )
    return None


def same_on_every_rank(tensors: list[torch.Tensor], mesh: DeviceMesh) -> bool:
    """Whether every process of `mesh` holds the same `tensors` (two checksums, compared by a MIN and a
    MAX all-reduce over the mesh's group): the cp processes of a replica must split the same sequences."""
    import torch.distributed as dist

    flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])
    weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.float64)  # order counts too
    sums = torch.stack([flat.sum(), (flat * weights).sum()])
    low, high = sums.clone(), sums.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=mesh.get_group())
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=mesh.get_group())
    return bool(torch.equal(low, high))


class ContextParallel:
    """Runs a step's micro-batches with their sequences split over the mesh `mesh` (the "cp" dimension)."""

    def __init__(self, module: nn.Module, mesh: DeviceMesh):
        if not offered(module).sequence_positions:
            raise ConfigError(
                f"parallel.cp_size > 1 splits the sequences of the built-in GPT (model.name=gpt), whose "
                f"positions it can split too; {type(module).__name__} has no `sequence_positions`: set "
                f"parallel.cp_size=1"
            )
        self.module, self.mesh = module, mesh
        self.checked = False  # whether the cp processes were seen to hold the same batches (first step)

    @contextlib.contextmanager
    def step(self, micro_batches: list[Any]) -> Iterator[None]:
        from torch.distributed.tensor.experimental import context_parallel
        from torch.nn.attention import SDPBackend, sdpa_kernel

        buffers = [t for batch in micro_batches for t in sequence_tensors(batch)]
        if not buffers:
            raise ConfigError(
                "parallel.cp_size > 1 needs token sequences: the batch holds no (batch, positions) tensor"
            )
        length = buffers[0].shape[1]
        problem = check_length(length, self.mesh.size())
        if problem:
            raise ConfigError(problem)
        if not self.checked:  # once: a data layer that gave them different samples trains on nonsense
            if not same_on_every_rank(buffers, self.mesh):
                raise DtrainError(
                    "parallel.cp_size > 1: the processes of one context-parallel group drew different "
                    "samples, and each must hold the same sequences to split them; set parallel.cp_size=1"
                )
            self.checked = True
        for t in buffers:  # own storage each: inputs and targets are often views of one window
            t.set_(t.contiguous().clone())  # type: ignore[call-overload]
        positions = torch.arange(length, device=buffers[0].device)
        set_sequence_positions(self.module, positions)
        # Only these kernels have a ring rule: the math kernel would attend within each rank's chunk only,
        # silently (torchtitan restricts them the same way).
        ring_kernels = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
        try:
            with (
                sdpa_kernel(ring_kernels),
                context_parallel(
                    self.mesh,
                    buffers=[*buffers, positions],
                    buffer_seq_dims=[1] * len(buffers) + [0],
                    no_restore_buffers={positions},
                ),
            ):
                yield
        finally:
            set_sequence_positions(self.module, None)
