"""The built-in GPT's tensor-parallel plan, with sequence parallel, as torchtitan shards a transformer.

    wte            row-wise: the vocabulary split; its output reduce-scattered over the sequence
    wpe            replicated; each rank keeps the positions of its sequence shard
    h.*.ln_1/ln_2  sequence parallel: each rank normalises its shard of the positions
    h.*.attn       the sequence gathered; heads split (n_head / tp per rank)
    attn.c_attn    column-wise (see FusedHeadsColwise), attn.c_proj row-wise, reduce-scattered
    mlp.c_fc       column-wise; mlp.c_proj row-wise, reduce-scattered over the sequence
    ln_f           sequence parallel; lm_head column-wise (tied to wte, as both split the vocabulary)
    the logits     left split over the vocabulary where dtrain's own cross-entropy takes them (loss
                   parallel: each rank holds B × T × V / tp of them, the loss's softmax reduced over
                   the ranks), else gathered whole (a user's loss_fn or step_fn, a pipeline stage)

Dropouts run on each rank's sequence shard as they are (element-wise). Between blocks the activation
is each rank's shard of the positions (a plain tensor); parameters are DTensors on the tensor-parallel
mesh, every one sharded or replicated as stored, so checkpoints (DCP) reshard onto any layout.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from dtrain.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def plan(loss_parallel: bool = False) -> dict[str, ParallelStyle]:
    """Module names (parallelize_module's patterns) → how each is split over the tensor-parallel mesh;
    with `loss_parallel` the logits come as a DTensor split over the vocabulary, for a loss computed
    inside torch's `loss_parallel()` (dtrain's step and evaluation enter it: parallel/base.py)."""
    logits = Shard(-1) if loss_parallel else Replicate()
    return {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "wpe": PositionsOfTheShard(),
        "h.*.ln_1": SequenceParallel(),
        "h.*.attn": LocalHeads(),
        "h.*.attn.c_attn": FusedHeadsColwise(),
        "h.*.attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
        "h.*.ln_2": SequenceParallel(),
        "h.*.mlp": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
        "h.*.mlp.c_fc": ColwiseParallel(),
        "h.*.mlp.c_proj": RowwiseParallel(output_layouts=Shard(1)),
        "ln_f": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=logits, use_local_output=not loss_parallel),
    }


def problem(
    n_head: int, n_embd: int, tp: int, window: int | None = None, sizes: Collection[int] | None = None
) -> str | None:
    """Why a GPT of `n_head` heads and width `n_embd` cannot be split over `tp` processes (windows of
    `window` tokens, which sequence parallel splits evenly), in one line naming what would (of `sizes`:
    those the world takes), or None."""
    if n_head % tp == 0 and n_embd % tp == 0:
        return None if window is None or window % tp == 0 else _uneven(window, tp)
    fits = [
        d
        for d in range(1, n_head + 1)
        if n_head % d == 0 and n_embd % d == 0 and (window is None or window % d == 0) and (sizes is None or d in sizes)
    ]
    return (
        f"parallel.tp_size = {tp} must divide the GPT's heads (model.options.n_head = {n_head}) and width "
        f"(n_embd = {n_embd}), each rank holding whole heads; use parallel.tp_size in {fits}"
    )


class LocalHeads(PrepareModuleInput):
    """The attention of one block: its input (this rank's positions) gathered whole, and its head count
    the heads this rank holds, which its forward splits c_attn's output into."""

    def __init__(self) -> None:
        super().__init__(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None), use_local_output=True
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        heads: int = module.n_head  # type: ignore[assignment]
        setattr(module, "n_head", heads // device_mesh.size())  # noqa: B010 — an int on a Module
        return super()._apply(module, device_mesh)


class FusedHeadsColwise(ColwiseParallel):
    """Column-wise over c_attn, whose one weight stacks q, k and v (3 × n_embd rows). Its weight is
    sharded as stored (contiguous rows: rank 0 of 2 holds q and half of k), so that checkpoints and the
    optimizer's state are plain shards any layout reads. Its output is then gathered and each rank keeps
    q, k and v of its own heads: one all-gather of the q/k/v activations per block (a reduce-scatter of
    their gradients in backward), the price of the fused layout."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        module.register_forward_hook(lambda _mod, _inputs, output: _own_heads(output, device_mesh))
        return module


def _own_heads(qkv: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's columns of q, k, v (…, 3 × n_embd / tp) from its contiguous shard of their stack."""
    whole = (
        DTensor.from_local(qkv, mesh, [Shard(qkv.ndim - 1)], run_check=False)
        .redistribute(mesh, [Replicate()])
        .to_local(grad_placements=[Partial()])  # each rank's gradient covers its heads: summed in backward
    )
    rank, size = mesh.get_local_rank(), mesh.size()
    return torch.cat([part.chunk(size, dim=-1)[rank] for part in whole.chunk(3, dim=-1)], dim=-1)


class PositionsOfTheShard(ParallelStyle):
    """The position embedding: its weight replicated, its output cut to this rank's shard of the
    positions (the sequence dimension, second from last, for position ids with or without a batch)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # torch types these hooks as returning None; what they return replaces the input and output
        return distribute_module(
            module,
            device_mesh,
            input_fn=_replicated,  # type: ignore[arg-type]
            output_fn=_sequence_shard,  # type: ignore[arg-type]
        )


def _uneven(window: int, tp: int) -> str:
    below = window - window % tp
    return (
        f"data.block_size = {window}: sequence parallel splits each window's positions evenly over "
        f"parallel.tp_size = {tp}; use a multiple of {tp} ({below or tp} or {below + tp})"
    )


def _replicated(_module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
    # The first module to see the positions: a window they do not split evenly over is refused here, in
    # one line (gloo's uneven collectives would fail without saying why).
    if inputs[0].shape[-1] % mesh.size():
        raise ConfigError(_uneven(inputs[0].shape[-1], mesh.size()))
    return tuple(
        DTensor.from_local(x, mesh, [Replicate()], run_check=False) if isinstance(x, torch.Tensor) else x
        for x in inputs
    )


def _sequence_shard(_module: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
    return output.redistribute(mesh, [Shard(output.ndim - 2)]).to_local()
