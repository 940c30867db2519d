"""Pipeline parallel (`torch.distributed.pipelining`): each process holds a run of the model's blocks.

The model's blocks (blocks.py finds them; they must be the entries of one `nn.ModuleList`) are cut into
`pp_size × stages_per_rank` stages of about equal cost (`stage_sizes`: multiply-adds per token counted
from the layers' weights, so the last stage, which holds the head, takes fewer blocks; attention's cost
in the window length is left out), or of equal block counts (`distributed.pp_split = count`: memory
closer to even, where the first stage's embedding is big); pipeline process p holds stages p, p + pp_size, ...
(more than one only when interleaving). As torchtitan splits a model: a copy with the blocks of other
stages deleted and the modules before the blocks (embeddings) kept on the first stage only, those after
them (final norm, head) on the last only, the rest set to None. Every parameter keeps the whole model's
name (`h.3.attn...` on the second stage), so state dicts and checkpoints read as the whole model's and
resume under any layout. The model's forward must pass its input through a part that is None (the
built-in GPT does: models/gpt.py).

A step runs `distributed.pp_schedule` (gpipe, 1f1b, interleaved_1f1b) over the step's accumulation
micro-batches: the first stage is fed the inputs, the last stage computes each micro-batch's share of
the step's loss (the trainer's StepShares), so the update is one batch's of all the step's samples. A
parameter tied across stages (the GPT's embedding and head) is a copy on each holder; their gradients
are summed after backward, so the copies stay equal. Clipping takes the norm over every stage.

With `distributed.tp_size > 1` each stage's part is split over its tensor-parallel processes after the
cut (parallelize_stage: the plan's entries for modules the stage lacks left out); activations between
stages are then each tp rank's shard of the positions, sent to the same tp rank of the next stage, and
the tied copies' gradients are summed shard by shard. With data-parallel copies on top (`ddp`: pp × dp ×
tp), each stage averages its gradients over its replicas itself, once per step.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from dtrain.config import Config
from dtrain.data.batch import split
from dtrain.distributed import Session
from dtrain.errors import ConfigError, DtrainError
from dtrain.parallel import blocks
from dtrain.parallel.base import Strategy
from dtrain.parallel.dims import ParallelDims
from dtrain.parallel.dtensors import grad_norm, local, placed_as_parameter, whole
from dtrain.parallel.observer import CommObserver

SCHEDULES: dict[str, Any] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


def cost(module: nn.Module | None) -> int:
    """What `module` costs per token, in multiply-adds: the parameters of its layers that multiply (an
    embedding's are looked up, for free; a head tied to it multiplies by them all the same)."""
    if module is None:
        return 0
    return sum(
        p.numel() for m in module.modules() if not isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)
    )


def stage_sizes(costs: list[int], n_stages: int, first: int = 0, last: int = 0) -> list[int]:
    """Blocks per stage (at least one each, in order) so that the costliest stage costs least: `costs` per
    block, `first` and `last` what the first and last stages hold beside their blocks (embeddings; final
    norm and head, which in a GPT weigh several blocks). Of the splits as good, the most even (least sum
    of squared costs), then the one giving earlier stages more (equal blocks, free ends: the first
    stages take one more)."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def load(i: int, j: int, stage: int) -> int:  # blocks i..j-1 as stage `stage`
        return prefix[j] - prefix[i] + (first if stage == 0 else 0) + (last if stage == n_stages - 1 else 0)

    @functools.cache
    def best(i: int, stage: int, bound: int) -> tuple[float, tuple[int, ...]]:
        """Blocks i.. over stages stage..: (the least sum of squares within `bound`, the sizes)."""
        if stage == n_stages - 1:
            fine = i < n and load(i, n, stage) <= bound
            return (float(load(i, n, stage)) ** 2 if fine else math.inf), (n - i,)
        found: tuple[float, tuple[int, ...]] = (math.inf, ())
        for j in range(n - n_stages + stage + 1, i, -1):  # more blocks first: kept on a tie
            if load(i, j, stage) <= bound:
                rest, sizes = best(j, stage + 1, bound)
                if float(load(i, j, stage)) ** 2 + rest < found[0]:
                    found = (float(load(i, j, stage)) ** 2 + rest, (j - i, *sizes))
        return found

    bounds = sorted({load(i, j, s) for s in range(n_stages) for i in range(n) for j in range(i + 1, n + 1)})
    bound = next(b for b in bounds if best(0, 0, b)[0] < math.inf)
    return list(best(0, 0, bound)[1])


def bubble(pp: int, micro_batches: int, per_rank: int = 1) -> float:
    """The schedule's idle share of a step in theory: (p−1)/(v·m+p−1) (v = 1 for GPipe and 1F1B)."""
    return (pp - 1) / (per_rank * micro_batches + pp - 1)


def split_problem(n_blocks: int, pp: int, per_rank: int) -> str | None:
    """Why `pp` processes of `per_rank` stages each cannot split `n_blocks` blocks, or None."""
    stages = pp * per_rank
    if stages <= n_blocks:
        return None
    fits = list(range(2, n_blocks // per_rank + 1))
    made = f"distributed.pp_size = {pp}" + (f" × pp_stages_per_rank = {per_rank}" if per_rank > 1 else "")
    would = f"use distributed.pp_size = {' or '.join(map(str, fits))}" if fits else "use distributed.pp_size = 1"
    if per_rank > 1 and n_blocks >= pp:  # one stage per process would fit
        would += " or distributed.pp_schedule = 1f1b (one stage per process)"
    blocks_said = f"{n_blocks} block" + ("" if n_blocks == 1 else "s")
    return f"{made} makes {stages} pipeline stages and the model has {blocks_said}; {would}"


def block_list(module: nn.Module, names: list[str]) -> tuple[str, nn.ModuleList]:
    """The `nn.ModuleList` holding the model's blocks, by its name; refused in one line where none does."""
    found = {id(b) for b in blocks.find_blocks(module, names)}
    for name, sub in module.named_modules():
        if isinstance(sub, nn.ModuleList) and found and {id(b) for b in sub} == found:
            return name, sub
    raise ConfigError(
        f"distributed.pp_size > 1 splits a model's blocks held in one nn.ModuleList, and "
        f"{type(module).__name__}'s are not (name its block class in model.blocks); or set distributed.pp_size=1"
    )


def check_model(module: nn.Module, config: Config) -> None:
    """Refuse, in one line, a model the pipeline cannot split as `distributed` says (the launcher asks, on
    the model built on the meta device)."""
    dc = config.distributed
    if dc.pp_size <= 1:
        return
    _, listed = block_list(module, config.model.blocks)
    problem = split_problem(len(listed), dc.pp_size, dc.stages_per_rank)
    if problem:
        raise ConfigError(problem)


class KeptBlocks(nn.Module):
    """A stage's blocks under their places in the whole model's list (`h.4`, not `h.0`): names, state
    dicts and checkpoints stay the whole model's. Iterates its blocks as the list did."""

    def __init__(self, kept: dict[int, nn.Module]):
        super().__init__()
        for index, block in kept.items():
            self.add_module(str(index), block)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(cast(dict[str, nn.Module], self._modules).values())

    def __len__(self) -> int:
        return len(self._modules)


class _Layout:
    """Which blocks and ends each stage holds, and which stages this pipeline process holds."""

    def __init__(
        self, module: nn.Module, list_name: str, n_blocks: int, pp: int, pp_rank: int, per_rank: int, by: str = "cost"
    ):
        self.path = list_name.split(".")
        self.n_stages = pp * per_rank
        self.mine = [pp_rank + k * pp for k in range(per_rank)]  # this process's stages, in order
        self.pp = pp
        # The modules beside the blocks' list and beside each of its ancestors: before it, the first
        # stage's (embeddings); after it, the last stage's (final norm, head).
        self.before: list[str] = []
        self.after: list[str] = []
        node, prefix = module, ""
        for part in self.path:
            names = list(node._modules)
            at = names.index(part)
            self.before += [prefix + n for n in names[:at]]
            self.after += [prefix + n for n in names[at + 1 :]]
            node, prefix = cast(nn.Module, node._modules[part]), prefix + part + "."
        # By cost (distributed.pp_split): the stage with the head takes fewer blocks; by count, as many.
        listed = cast(nn.ModuleList, module.get_submodule(list_name))
        if by == "cost":
            ends = [sum(cost(module.get_submodule(n)) for n in names) for names in (self.before, self.after)]
            sizes = stage_sizes([cost(b) for b in listed][:n_blocks], self.n_stages, *ends)
        else:
            sizes = stage_sizes([1] * n_blocks, self.n_stages)
        starts = [sum(sizes[:s]) for s in range(self.n_stages)]
        self.blocks_of = [list(range(starts[s], starts[s] + sizes[s])) for s in range(self.n_stages)]

    def dropped(self, stages: list[int]) -> list[str]:
        """The ends that `stages` together do not hold."""
        return ([] if 0 in stages else self.before) + ([] if self.n_stages - 1 in stages else self.after)


def _shallow(module: nn.Module) -> nn.Module:
    """A copy sharing every parameter, buffer and child, whose children can be swapped on their own."""
    twin = copy.copy(module)
    twin._modules = dict(module._modules)
    return twin


def _set_none(root: nn.Module, fqn: str) -> None:
    parent, _, leaf = fqn.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, None)


def split_model(module: nn.Module, list_name: str, layout: _Layout) -> tuple[nn.Module, list[nn.Module]]:
    """This process's part of `module` (one copy: the blocks of all its stages, the ends it holds, under
    the whole model's names), and a view of it per stage (sharing its modules) that runs that stage."""
    held = [i for s in layout.mine for i in layout.blocks_of[s]]
    part = copy.deepcopy(module)
    listed = cast(nn.ModuleList, part.get_submodule(list_name))
    parent, _, leaf = list_name.rpartition(".")
    setattr(part.get_submodule(parent) if parent else part, leaf, KeptBlocks({i: listed[i] for i in held}))
    for fqn in layout.dropped(layout.mine):
        _set_none(part, fqn)
    if len(layout.mine) == 1:  # one stage: the part is its view (what FSDP inside the stage needs)
        return part, [part]
    views = []
    for stage in layout.mine:
        view = node = _shallow(part)
        for name in layout.path[:-1]:
            child = _shallow(cast(nn.Module, node._modules[name]))
            node._modules[name], node = child, child
        kept = cast(KeptBlocks, part.get_submodule(list_name))
        node._modules[layout.path[-1]] = KeptBlocks({i: kept.get_submodule(str(i)) for i in layout.blocks_of[stage]})
        for fqn in layout.dropped([stage]):
            _set_none(view, fqn)
        views.append(view)
    return part, views


class _Stages(nn.Module):
    """What the trainer calls `model` under PP: this process's part (a child, so train()/eval() reach
    every block), whose forward runs the stages forward only, one eval batch at a time: the first stage
    takes the inputs, each passes its activations to the next (point to point), the last returns the
    model's output (None on other processes)."""

    def __init__(self, part: nn.Module, views: list[nn.Module], layout: _Layout, group: Any, ranks: list[int]):
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
        config: Config,
        observer: CommObserver,
        tp_plan: Mapping[str, Any] | None = None,
    ):
        dc = config.distributed
        sharded = dims.dp_shard > 1  # FSDP inside each stage (one stage per process: pipeline_problem)
        mesh = dims.world_mesh(session.device.type)
        self.group = mesh["pp"].get_group()
        # The copies of this stage on the other data-parallel processes, whose gradients it averages with.
        # Under FSDP its reduce-scatter (HSDP's all-reduce too) averages them instead.
        self.replicas = mesh["dp_replicate"].get_group() if dims.dp_replicate > 1 and not sharded else None
        self.ranks = dist.get_process_group_ranks(self.group)
        pp_rank = mesh["pp"].get_local_rank()
        list_name, listed = block_list(module, config.model.blocks)
        problem = split_problem(len(listed), dims.pp, dc.stages_per_rank)
        if problem:
            raise ConfigError(problem)
        self.whole_names = list(module.state_dict())
        self.layout = _Layout(module, list_name, len(listed), dims.pp, pp_rank, dc.stages_per_rank, dc.pp_split)
        self._tied_groups = tied = _tied_names(module)
        whole = dict(module.named_parameters(remove_duplicate=False))
        # The shapes of each tied group, for a process that holds none of it.
        self._tied_like = [(whole[names[0]].shape, whole[names[0]].dtype) for names in tied]  # local: _share_tied
        part, views = split_model(module, list_name, self.layout)
        if dims.tp > 1:  # each stage's layers split over the tensor-parallel processes of this stage
            parallelize_stage(part, mesh["tp"], dims.coordinate(session.rank)["tp"], tp_plan)
        # Checkpointing and compiling block by block, on this process's blocks only (after the copy:
        # they replace each block's forward in place).
        units = blocks.apply_block_options(part, config, session.device, sharded=sharded, quiet=session.rank != 0)
        if sharded:  # then FSDP over the stage's data-parallel processes, torchtitan's order
            from dtrain.parallel import fsdp

            fsdp.shard(part, units, dims.dp_mesh(session.device.type), config, session.device)
            self.shards_state = self.comm_in_compute = True
        self.first, self.last = 0 in self.layout.mine, self.layout.n_stages - 1 in self.layout.mine
        super().__init__(part, dims)
        # What checkpoints may hold beyond this stage's names: the rest of the whole model (parts.py).
        part.pipeline_whole_names = frozenset(self.whole_names)  # type: ignore[assignment]
        # Each tied parameter's other names, under which a checkpoint may hold its optimizer state.
        part.pipeline_tied = {n: [o for o in group if o != n] for group in tied for n in group}  # type: ignore[assignment]
        self.model = _Stages(part, views, self.layout, self.group, self.ranks)
        self.stages = [
            PipelineStage(view, stage, self.layout.n_stages, session.device, group=self.group)
            for view, stage in zip(views, self.layout.mine, strict=True)
        ]
        self.schedule_name, self.per_rank = dc.pp_schedule, dc.stages_per_rank
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
        """The whole model on rank 0: each stage's tensors sent to it one at a time (a tensor-parallel one
        gathered whole first, by its stage's processes together)."""
        state = {k: v.detach() for k, v in self.module.state_dict().items()}
        listings: list[Any] = [None] * self.layout.pp
        listing = [(k, tuple(v.shape), str(v.dtype)) for k, v in state.items()]
        dist.all_gather_object(listings, listing, group=self.group)
        here, main = self.layout.mine[0], dist.get_rank() == 0
        full: dict[str, torch.Tensor] = {}
        for owner, listing in enumerate(listings):
            for name, shape, dtype in listing:
                if name in full or (owner > 0 and any(name in {n for n, _, _ in listings[o]} for o in range(owner))):
                    continue  # held by an earlier stage too (a tied copy): taken from there
                value = state[name] if here == owner else None
                if value is not None:  # a DTensor: a collective of the stage's tp (and dp) processes
                    value = whole(value)
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

    found = tensor.problem(part, mesh.size(), plan)
    if found:
        raise ConfigError(found)
    if plan is None and not callable(getattr(part, "tp_plan", None)):
        raise ConfigError(
            f"distributed.pp_size > 1 with distributed.tp_size = {mesh.size()} splits each stage by a plan given "
            f"as Trainer(tp_plan=...) or the model's tp_plan() method, and {type(part).__name__} has neither; "
            f"{tensor.HOW}"
        )
    whole = dict(plan) if plan is not None else part.tp_plan()  # type: ignore[operator]
    tensor.parallelize(part, mesh, {k: v for k, v in whole.items() if _held(part, k)})
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
            "distributed.pp_size > 1 feeds the first stage one tensor and gives the last stage the target: "
            "batches must be (inputs, target) tensors, the loss cross-entropy or Trainer(loss_fn=...) "
            "(no step_fn); or set distributed.pp_size=1"
        )
    sizes = {x.shape[0] for x, _ in pairs}
    if len(sizes) > 1:
        raise DtrainError(
            f"distributed.pp_size > 1 needs micro-batches of one size and this step's hold {sorted(sizes)} "
            f"samples; set data.drop_last=true"
        )
    return torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs])
