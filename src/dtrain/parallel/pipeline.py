"""Pipeline parallel (`torch.distributed.pipelining`): each process holds a run of the model's blocks.

The model is cut into stages by stages.py (by cost or by count, each keeping the whole model's names);
each process holds its stages' part (one copy) and a view per stage.

A step runs `parallel.pp_schedule` (gpipe, 1f1b, interleaved_1f1b) over the step's accumulation
micro-batches: the first stage is fed the inputs, the last stage computes each micro-batch's share of
the step's loss (the trainer's StepShares), so the update is one batch's of all the step's samples. A
parameter tied across stages (the GPT's embedding and head) is a copy on each holder; their gradients
are summed after backward, so the copies stay equal. Clipping takes the norm over every stage.

With `parallel.tp_size > 1` each stage's part is split over its tensor-parallel processes after the
cut (parallelize_stage: the plan's entries for modules the stage lacks left out); activations between
stages are then each tp rank's shard of the positions, sent to the same tp rank of the next stage, and
the tied copies' gradients are summed shard by shard. With data-parallel copies on top, under `ddp`
each stage averages its gradients over its replicas itself, once per step; under `fsdp`/`hsdp` each
stage's part is sharded over them (fsdp.shard) and FSDP reduces its gradients.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from dtrain.data.batch import split
from dtrain.distributed import Session
from dtrain.errors import ConfigError, DtrainError
from dtrain.parallel import blocks
from dtrain.parallel.base import StageNames, Strategy
from dtrain.parallel.dims import ParallelDims
from dtrain.parallel.dtensors import grad_norm, local, placed_as_parameter, whole
from dtrain.parallel.observer import CommObserver
from dtrain.parallel.options import StrategyOptions
from dtrain.parallel.stages import Layout, block_list, split_model, split_problem

SCHEDULES: dict[str, Any] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


def bubble(pp: int, micro_batches: int, per_rank: int = 1) -> float:
    """The schedule's idle share of a step in theory: (p−1)/(v·m+p−1) (v = 1 for GPipe and 1F1B)."""
    return (pp - 1) / (per_rank * micro_batches + pp - 1)


class _Stages(nn.Module):
    """What the trainer calls `model` under PP: this process's part (a child, so train()/eval() reach
    every block), whose forward runs the stages forward only, one eval batch at a time: the first stage
    takes the inputs, each passes its activations to the next (point to point), the last returns the
    model's output (None on other processes)."""

    def __init__(self, part: nn.Module, views: list[nn.Module], layout: Layout, group: Any, ranks: list[int]):
        super().__init__()
        self.part = part
        self._views, self._layout, self._group, self._ranks = views, layout, group, ranks

    def train(self, mode: bool = True) -> _Stages:
        super().train(mode)
        for view in self._views:  # the views' own roots (shallow copies) follow too
            view.train(mode)
        return self

    def forward(self, inputs: torch.Tensor) -> torch.Tensor | None:
        layout, x = self._layout, inputs
        for view, stage in zip(self._views, layout.mine, strict=True):
            if stage > 0:
                x = _receive(self._ranks[(stage - 1) % layout.pp], x.device)
            x = view(x)
            if not isinstance(x, torch.Tensor):
                raise DtrainError(
                    f"pipeline stage {stage} returned {type(x).__name__}; a stage before the last must return "
                    f"one tensor (its activations)"
                )
            if stage < layout.n_stages - 1:
                _send(x, self._ranks[(stage + 1) % layout.pp])
        return x if layout.n_stages - 1 in layout.mine else None


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_HEADER = 8  # dimensions, dtype, up to 6 sizes


def _send(x: torch.Tensor, to: int) -> None:
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = x.dim(), _DTYPES.index(x.dtype)
    header[2 : 2 + x.dim()] = torch.tensor(x.shape)
    dist.send(header.to(x.device), dst=to)
    dist.send(x.detach().contiguous(), dst=to)


def _receive(source: int, device: torch.device) -> torch.Tensor:
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src=source)
    dims, dtype = int(header[0]), _DTYPES[int(header[1])]
    x = torch.empty(header[2 : 2 + dims].tolist(), dtype=dtype, device=device)
    dist.recv(x, src=source)
    return x


class Pipeline(Strategy):
    """This process's stages of the model (`module`: one module under the whole model's names), run by
    a pipelining schedule over each step's micro-batches."""

    forward_is_collective = True  # a stage's forward waits for the previous stage's activations

    def __init__(
        self,
        module: nn.Module,
        session: Session,
        dims: ParallelDims,
        options: StrategyOptions,
        observer: CommObserver,
        tp_plan: Mapping[str, Any] | None = None,
    ):
        staging = options.pipeline
        sharded = dims.dp_shard > 1  # FSDP inside each stage (one stage per process: pipeline_problem)
        mesh = dims.world_mesh(session.device.type)
        self.group = mesh["pp"].get_group()
        # The copies of this stage on the other data-parallel processes, whose gradients it averages with.
        # Under FSDP its reduce-scatter (HSDP's all-reduce too) averages them instead.
        self.replicas = mesh["dp_replicate"].get_group() if dims.dp_replicate > 1 and not sharded else None
        self.ranks = dist.get_process_group_ranks(self.group)
        pp_rank = mesh["pp"].get_local_rank()
        list_name, listed = block_list(module, list(options.blocks.names))
        problem = split_problem(len(listed), dims.pp, staging.stages_per_rank)
        if problem:
            raise ConfigError(problem)
        self.whole_names = list(module.state_dict())
        self.layout = Layout(module, list_name, len(listed), dims.pp, pp_rank, staging.stages_per_rank, staging.split)
        self._tied_groups = tied = _tied_names(module)
        whole = dict(module.named_parameters(remove_duplicate=False))
        # The shapes of each tied group, for a process that holds none of it.
        self._tied_like = [(whole[names[0]].shape, whole[names[0]].dtype) for names in tied]  # local: _share_tied
        part, views = split_model(module, list_name, self.layout)
        if dims.tp > 1:  # each stage's layers split over the tensor-parallel processes of this stage
            parallelize_stage(part, mesh["tp"], dims.coordinate(session.rank)["tp"], tp_plan)
        # Checkpointing and compiling block by block, on this process's blocks only (after the copy:
        # they replace each block's forward in place).
        quiet = session.rank != 0
        units = blocks.apply_block_options(part, options.blocks, session.device, sharded=sharded, quiet=quiet)
        if sharded:  # then FSDP over the stage's data-parallel processes, torchtitan's order
            from dtrain.parallel import fsdp

            fsdp.shard(part, units, dims.dp_mesh(session.device.type), options.fsdp, session.device)
            self.shards_state = self.comm_in_compute = True
        self.first, self.last = 0 in self.layout.mine, self.layout.n_stages - 1 in self.layout.mine
        super().__init__(part, dims)
        # What checkpoints may hold beyond this stage's names (the rest of the whole model), and each tied
        # parameter's other names, under which a checkpoint may hold its optimizer state (checkpoint/parts.py).
        others = {n: tuple(o for o in group if o != n) for group in tied for n in group}
        self.stage = StageNames(frozenset(self.whole_names), others)
        self.model = _Stages(part, views, self.layout, self.group, self.ranks)
        self.stages = [
            PipelineStage(view, stage, self.layout.n_stages, session.device, group=self.group)
            for view, stage in zip(views, self.layout.mine, strict=True)
        ]
        self.schedule_name, self.per_rank = staging.schedule, staging.stages_per_rank
        self._schedules: dict[int, Any] = {}
        self._shares: Any = None
        self._loss_index = 0
        self.observer = observer
        self._tied, self._counted = self._share_tied(tied, part)

    @property
    def computes_loss(self) -> bool:  # type: ignore[override]
        return self.last

    @property
    def eval_module(self) -> nn.Module:
        return self.model

    def _share_tied(self, tied: list[list[str]], part: nn.Module) -> tuple[list[tuple[int, nn.Parameter | None]], list]:
        """The tied parameters held on several pipeline processes ((its group's index, this copy or None)),
        and the parameters whose gradients this process counts in the global norm (a tied one once, by
        the first process holding it)."""
        present = dict(part.named_parameters(remove_duplicate=False))
        mine = [next((present[n] for n in names if n in present), None) for names in tied]
        gathered: list[Any] = [None] * self.layout.pp
        held = [None if p is None else (tuple(local(p).shape), p.dtype) for p in mine]
        dist.all_gather_object(gathered, held, group=self.group)
        holders = [[h is not None for h in row] for row in gathered]
        for g in range(len(tied)):  # the shape of a holder's copy (its tensor-parallel shard), for the others
            self._tied_like[g] = next((row[g] for row in gathered if row[g] is not None), self._tied_like[g])
        pp_rank = self.layout.mine[0]
        shared, not_counted = [], set()
        for g, param in enumerate(mine):
            held_by = [r for r in range(self.layout.pp) if holders[r][g]]
            if len(held_by) > 1:
                shared.append((g, param))
                if param is not None and held_by[0] != pp_rank:
                    not_counted.add(id(param))
        counted = [p for p in part.parameters() if id(p) not in not_counted]
        return shared, counted

    def _schedule(self, micro_batches: int) -> Any:
        if micro_batches not in self._schedules:
            kind = SCHEDULES[self.schedule_name]
            multi = self.schedule_name == "interleaved_1f1b"
            self._schedules[micro_batches] = kind(
                self.stages if multi else self.stages[0],
                n_microbatches=micro_batches,
                loss_fn=self._loss,
                scale_grads=False,  # each micro-batch's loss is its share of the step already
            )
        return self._schedules[micro_batches]

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        index, self._loss_index = self._loss_index, self._loss_index + 1
        return self._shares.of_output(index, output, target)

    def forward_backward(self, micro_batches: list[Any], shares: Any, precision: Any) -> torch.Tensor:
        inputs, targets = _stacked(micro_batches, shares)
        self._shares, self._loss_index = shares, 0
        self.observer.pipeline_bubble(bubble(self.layout.pp, len(micro_batches), self.per_rank))
        losses: list[torch.Tensor] = []
        with precision.autocast():
            schedule = self._schedule(len(micro_batches))
            args = (inputs,) if self.first else ()
            schedule.step(*args, **({"target": targets, "losses": losses} if self.last else {}))
        self._sum_tied_gradients()
        self._average_over_replicas()
        device = inputs.device
        total = torch.stack(losses).sum().detach().float() if self.last else torch.zeros((), device=device)
        dist.all_reduce(total, group=self.group)  # every stage logs the last stage's loss
        return total

    def _sum_tied_gradients(self) -> None:
        device = next(self.module.parameters()).device
        for g, param in self._tied:
            if param is None:  # a stage between the holders adds zeros: every process joins each all-reduce
                shape, dtype = self._tied_like[g]
                dist.all_reduce(torch.zeros(shape, dtype=dtype, device=device), group=self.group)
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            param.grad = placed_as_parameter(param.grad, param)
            # The holders split it alike over their tensor-parallel processes: shard meets matching shard.
            dist.all_reduce(local(param.grad), group=self.group)

    def _average_over_replicas(self) -> None:
        """Data parallel across the pipelines: each stage's gradients averaged over its copies, in one
        all-reduce of them all (as DDP would, once per step: the micro-batches only add locally)."""
        if self.replicas is None:
            return
        params = list(self.module.parameters())
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [local(cast(torch.Tensor, p.grad)) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.replicas)
        flat /= self.dims.dp_replicate
        for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(part.view_as(g))

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        grads = [p.grad.detach() for p in self._counted if p.grad is not None]
        device = next(self.module.parameters()).device
        squares = grad_norm(grads).to(device, torch.float32).pow(2)  # over this stage's shards (tensor parallel)
        dist.all_reduce(squares, group=self.group)
        norm = squares.sqrt()
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # as nn.utils.clip_grad_norm_
        for p in self.module.parameters():
            if p.grad is not None:
                local(p.grad).mul_(scale.to(p.grad.dtype))
        return norm

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model on rank 0: each stage's tensors sent to it one at a time (a DTensor gathered
        whole first, by its stage's tensor- and data-parallel processes together). Only rank 0's pipeline
        sends: the other pipelines (other dp, tp coordinates) take part in the gathers and send nothing."""
        state = {k: v.detach() for k, v in self.module.state_dict().items()}
        listings: list[Any] = [None] * self.layout.pp
        listing = [(k, tuple(v.shape), str(v.dtype)) for k, v in state.items()]
        dist.all_gather_object(listings, listing, group=self.group)
        here, main = self.layout.mine[0], dist.get_rank() == 0
        carries = self.ranks[0] == 0  # this pipeline holds rank 0
        full: dict[str, torch.Tensor] = {}
        for owner, listing in enumerate(listings):
            for name, shape, dtype in listing:
                if name in full or (owner > 0 and any(name in {n for n, _, _ in listings[o]} for o in range(owner))):
                    continue  # held by an earlier stage too (a tied copy): taken from there
                value = state[name] if here == owner else None
                if value is not None:  # a DTensor: a collective of the stage's tp (and dp) processes
                    value = whole(value)
                if not carries:
                    continue
                if owner == here == 0:
                    full[name] = cast(torch.Tensor, value).cpu() if main else cast(torch.Tensor, value).new_empty(0)
                elif here == owner:
                    dist.send(cast(torch.Tensor, value).contiguous(), dst=self.ranks[0])
                elif here == 0:
                    received = torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")))
                    dist.recv(received, src=self.ranks[owner])
                    full[name] = received if main else received.new_empty(0)
        if not main:
            return None
        for names in self._tied_groups:  # one tensor under every name, as the whole model's state dict has it
            held = next((full[n] for n in names if n in full), None)
            full.update(dict.fromkeys(names, held) if held is not None else {})
        return {name: full[name] for name in self.whole_names if name in full}


def parallelize_stage(part: nn.Module, mesh: Any, tp_rank: int, plan: Mapping[str, Any] | None = None) -> None:
    """Split this process's part of the model over `mesh` (the stage's tensor-parallel processes) by
    `plan`, else the model's own, leaving out what the stage does not hold (the ends set to None); under
    the model's own plan, its dropout moves onto this tp rank's stream (dropout.py)."""
    from dtrain.parallel import dropout, tensor

    found = tensor.problem(part, mesh.size(), plan)  # no plan at all: one line saying how to give one
    if found:
        raise ConfigError(found)
    chosen = dict(plan) if plan is not None else part.tp_plan()  # type: ignore[operator]
    tensor.parallelize(part, mesh, {k: v for k, v in chosen.items() if _held(part, k)})
    if plan is None:
        dropout.own_streams(part, tp_rank)


def _held(part: nn.Module, pattern: str) -> bool:
    """Whether the stage holds the module `pattern` names (its parts before any wildcard)."""
    node: Any = part
    for atom in pattern.split("."):
        if "*" in atom:
            return node is not None and len(node._modules) > 0
        node = node._modules.get(atom) if isinstance(node, nn.Module) else None
        if node is None:
            return False
    return True


def _tied_names(module: nn.Module) -> list[list[str]]:
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _stacked(micro_batches: list[Any], shares: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's micro-batches as one batch of inputs and one of targets (the schedule cuts it back)."""
    pairs = [split(batch) for batch in micro_batches]
    if getattr(shares.loss_of, "step_fn", None) is not None or not all(
        isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and not isinstance(b, dict)
        for (x, y), b in zip(pairs, micro_batches, strict=True)
    ):
        raise DtrainError(
            "parallel.pp_size > 1 feeds the first stage one tensor and gives the last stage the target: "
            "batches must be (inputs, target) tensors, the loss cross-entropy or Trainer(loss_fn=...) "
            "(no step_fn); or set parallel.pp_size=1"
        )
    sizes = {x.shape[0] for x, _ in pairs}
    if len(sizes) > 1:
        raise DtrainError(
            f"parallel.pp_size > 1 needs micro-batches of one size and this step's hold {sorted(sizes)} "
            f"samples; set data.drop_last=true"
        )
    return torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs])
