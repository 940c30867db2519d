"""How a model is cut into pipeline stages (pipeline.py runs them).

The model's blocks (blocks.py finds them; they must be the entries of one `nn.ModuleList`) are cut into
`pp_size × stages_per_rank` stages of about equal cost (`stage_sizes`: multiply-adds per token counted
from the layers' weights, so the last stage, which holds the head, takes fewer blocks; attention's cost
in the window length is left out), or of equal block counts (`parallel.pp_split = count`: memory
closer to even, where the first stage's embedding is big); pipeline process p holds stages p,
p + pp_size, ... (more than one only when interleaving). As torchtitan splits a model: a copy with the
blocks of other stages deleted and the modules before the blocks (embeddings) kept on the first stage
only, those after them (final norm, head) on the last only, the rest set to None. Every parameter keeps
the whole model's name (`h.3.attn...` on the second stage), so state dicts and checkpoints read as the
whole model's and resume under any layout. The model's forward must pass its input through a part that
is None (the built-in GPT does: models/gpt/model.py; parallel/model_hooks.py says so).
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Iterator
from typing import cast

from torch import nn

from dtrain.errors import ConfigError
from dtrain.parallel import blocks


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
    of squared costs, then of squared counts: blocks that cost nothing are shared out evenly), then the
    one giving earlier stages more (equal blocks, free ends: the first stages take one more)."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def load(i: int, j: int, stage: int) -> int:  # blocks i..j-1 as stage `stage`
        return prefix[j] - prefix[i] + (first if stage == 0 else 0) + (last if stage == n_stages - 1 else 0)

    @functools.cache
    def best(i: int, stage: int, bound: int) -> tuple[tuple[float, int], tuple[int, ...]]:
        """Blocks i.. over stages stage..: (the least sums of squared costs, then of squared counts,
        within `bound`; the sizes)."""
        if stage == n_stages - 1:
            fine = i < n and load(i, n, stage) <= bound
            return ((float(load(i, n, stage)) ** 2 if fine else math.inf, (n - i) ** 2)), (n - i,)
        found: tuple[tuple[float, int], tuple[int, ...]] = ((math.inf, 0), ())
        for j in range(n - n_stages + stage + 1, i, -1):  # more blocks first: kept on a tie
            if load(i, j, stage) <= bound:
                (rest, rest_count), sizes = best(j, stage + 1, bound)
                score = (float(load(i, j, stage)) ** 2 + rest, (j - i) ** 2 + rest_count)
                if score < found[0]:
                    found = (score, (j - i, *sizes))
        return found

    bounds = sorted({load(i, j, s) for s in range(n_stages) for i in range(n) for j in range(i + 1, n + 1)})
    bound = next(b for b in bounds if best(0, 0, b)[0][0] < math.inf)
    return list(best(0, 0, bound)[1])


def split_problem(n_blocks: int, pp: int, per_rank: int) -> str | None:
    """Why `pp` processes of `per_rank` stages each cannot split `n_blocks` blocks, or None."""
    stages = pp * per_rank
    if stages <= n_blocks:
        return None
    fits = list(range(2, n_blocks // per_rank + 1))
    made = f"parallel.pp_size = {pp}" + (f" × pp_stages_per_rank = {per_rank}" if per_rank > 1 else "")
    would = f"use parallel.pp_size = {' or '.join(map(str, fits))}" if fits else "use parallel.pp_size = 1"
    if per_rank > 1 and n_blocks >= pp:  # one stage per process would fit
        would += " or parallel.pp_schedule = 1f1b (one stage per process)"
    blocks_said = f"{n_blocks} block" + ("" if n_blocks == 1 else "s")
    return f"{made} makes {stages} pipeline stages and the model has {blocks_said}; {would}"


def block_list(module: nn.Module, names: list[str]) -> tuple[str, nn.ModuleList]:
    """The `nn.ModuleList` holding the model's blocks, by its name; refused in one line where none does."""
    found = {id(b) for b in blocks.find_blocks(module, names)}
    for name, sub in module.named_modules():
        if isinstance(sub, nn.ModuleList) and found and {id(b) for b in sub} == found:
            return name, sub
    raise ConfigError(
        f"parallel.pp_size > 1 splits a model's blocks held in one nn.ModuleList, and "
        f"{type(module).__name__}'s are not (name its block class in model.blocks); or set parallel.pp_size=1"
    )


def check_model(module: nn.Module, block_names: list[str], pp_size: int, stages_per_rank: int) -> None:
    """Refuse, in one line, a model the pipeline cannot split into `pp_size` × `stages_per_rank` stages of
    its blocks (the launcher asks, on the model built on the meta device)."""
    if pp_size <= 1:
        return
    _, listed = block_list(module, block_names)
    problem = split_problem(len(listed), pp_size, stages_per_rank)
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


class Layout:
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
        # By cost (parallel.pp_split): the stage with the head takes fewer blocks; by count, as many.
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


def split_model(module: nn.Module, list_name: str, layout: Layout) -> tuple[nn.Module, list[nn.Module]]:
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
