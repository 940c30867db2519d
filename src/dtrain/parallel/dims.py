"""The degrees of parallelism a job runs with, named and validated together (as torchtitan's
`ParallelDims`): a strategy is a composition of these dimensions, not a class per combination.

    pp            pipeline stages: each group of processes holds a run of the model's blocks
    dp_replicate  copies of the model that average their gradients (DDP; HSDP across its groups)
    dp_shard      processes the parameters, gradients and optimizer state are sharded over (FSDP;
                  HSDP within a group)
    cp            context parallel: each sequence split over these processes (CUDA only)
    tp            tensor parallel: each layer's weights split over these processes

Their product is the world size. `parallel.tp_size`, `pp_size` and `cp_size` fix theirs; the data
dimensions take the rest, as `parallel.strategy` says. One device mesh holds them all, outermost
first in the order above: tensor-parallel groups are consecutive ranks (inside one node), pipeline
stages the slowest-changing coordinate (across groups of nodes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from dtrain.config import ParallelConfig
from dtrain.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# Why the model cannot be split over that many tensor-parallel processes, in one line offering sizes of
# those given (all where None); None where it can.
TpProblem = Callable[[int, Collection[int] | None], str | None]

ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # the mesh's dimensions, outermost first
_KEYS = {"tp": "parallel.tp_size", "pp": "parallel.pp_size", "cp": "parallel.cp_size"}


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    _meshes: dict = field(default_factory=dict, init=False, compare=False, repr=False)  # built once per device type

    def __post_init__(self) -> None:
        for f in fields(self):
            degree = getattr(self, f.name)
            if f.name.startswith("_"):
                continue
            if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
                raise ConfigError(f"the {f.name} degree of parallelism must be a whole number >= 1; got {degree!r}")

    @classmethod
    def from_config(
        cls, parallel: ParallelConfig, world_size: int, local_world_size: int, tp_problem: TpProblem | None = None
    ) -> ParallelDims:
        """The dimensions these keys fill with `world_size` processes, `local_world_size` per node;
        refused in one line when they cannot. `tp_problem`: why the model cannot be split over that many
        tensor-parallel processes (None: it can), so that a refusal of tp_size gives the model's reason
        where it has one and offers only sizes that would work."""
        model = {"tp": parallel.tp_size, "pp": parallel.pp_size, "cp": parallel.cp_size}
        split = math.prod(model.values())
        if world_size % split:
            used = [k for k, v in model.items() if v > 1]
            if used == ["tp"] and tp_problem is not None:  # the model refuses this size on any world: that first
                said = tp_problem(parallel.tp_size, tp_sizes(parallel, world_size, local_world_size))
                if said:
                    raise ConfigError(said)
            named = " × ".join(f"{_KEYS[k]} = {model[k]}" for k in used)
            multiples = ", ".join(str(split * i) for i in range(1, 5))
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            if used == ["tp"] and tp_problem is not None:
                divisors = [d for d in divisors if tp_problem(d, None) is None]
            divisors = divisors[:8]
            instead = f"set sizes whose product divides {world_size}"
            if len(used) == 1:
                key = _KEYS[used[0]]
                instead = f"set {key}=1" if divisors == [1] else f"set {key} to one of {', '.join(map(str, divisors))}"
            raise ConfigError(
                f"{named} splits the model over {split} processes and the job has {world_size}; run a "
                f"multiple of {split} processes ({multiples}, ...) or {instead} (checkpoints resume under any "
                f"layout)"
            )
        inner = parallel.tp_size * parallel.cp_size  # the dimensions whose groups must lie within one node
        if inner > 1 and local_world_size % inner and world_size > local_world_size:
            raise ConfigError(
                f"parallel.tp_size × cp_size = {inner} would span nodes of {local_world_size} processes "
                f"(their all-gathers run every layer and need the node's fast links); use a divisor of "
                f"{local_world_size}, with FSDP or pipeline stages across the nodes"
            )
        dp = world_size // split
        if parallel.strategy == "fsdp":
            return cls(dp_shard=dp, **model)
        if parallel.strategy == "hsdp":
            # A node's data-parallel ranks of one pipeline stage (pp outermost: a stage's ranks are
            # consecutive, spanning nodes or sharing one).
            shard = parallel.hsdp_shard_size or max(1, min(local_world_size, world_size // parallel.pp_size) // inner)
            if dp % shard:
                raise ConfigError(
                    f"parallel.strategy = 'hsdp' shards over groups of {shard} processes "
                    f"(parallel.hsdp_shard_size, default: the processes of one node) and {dp} "
                    f"data-parallel processes do not divide into them; set parallel.hsdp_shard_size to a "
                    f"divisor of {dp}"
                )
            return cls(dp_replicate=dp // shard, dp_shard=shard, **model)
        return cls(dp_replicate=dp, **model)

    @property
    def world_size(self) -> int:
        return math.prod(getattr(self, name) for name in ORDER)

    @property
    def dp(self) -> int:
        """Processes that draw distinct samples: the data-parallel ones."""
        return self.dp_replicate * self.dp_shard

    @property
    def splits_model(self) -> bool:
        """Whether any dimension beyond data parallel is on (tensor, pipeline or context parallel)."""
        return self.tp * self.pp * self.cp > 1

    def coordinate(self, rank: int) -> dict[str, int]:
        """This rank's place on every dimension of the mesh (row-major over ORDER, as the mesh lays it out)."""
        place: dict[str, int] = {}
        for name in reversed(ORDER):
            rank, place[name] = divmod(rank, getattr(self, name))
        return {name: place[name] for name in ORDER}

    def dp_rank(self, rank: int) -> int:
        """Which data-parallel replica `rank` belongs to: the ranks of one replica (its tensor-, context-
        and pipeline-parallel peers) see the same samples."""
        at = self.coordinate(rank)
        return at["dp_replicate"] * self.dp_shard + at["dp_shard"]

    def describe(self) -> str:
        """The layout in a few words, e.g. 'pp 2 × dp 1 × tp 2' or 'dp 2 × fsdp 4' (HSDP): the dimensions in
        use, the data's always (dp: replicated, fsdp: sharded)."""
        parts = [f"pp {self.pp}"] if self.pp > 1 else []
        if self.dp_replicate > 1 or self.dp_shard == 1:
            parts.append(f"dp {self.dp_replicate}")
        parts += [f"fsdp {self.dp_shard}"] if self.dp_shard > 1 else []
        parts += [f"{name} {getattr(self, name)}" for name in ("cp", "tp") if getattr(self, name) > 1]
        return " × ".join(parts)

    def world_mesh(self, device_type: str) -> DeviceMesh:
        """The one device mesh of the job, over the dimensions of degree > 1 (named as in ORDER), built
        once; every strategy takes its groups from it (`mesh[name]`)."""
        if device_type not in self._meshes:
            from torch.distributed.device_mesh import init_device_mesh

            # A data dimension always (of size 1 where the model is split over every process), so that
            # a sharded strategy has one to name.
            data = "dp_shard" if self.dp_shard > 1 or self.dp_replicate == 1 else "dp_replicate"
            used = [name for name in ORDER if getattr(self, name) > 1 or name == data]
            shape = tuple(getattr(self, name) for name in used)
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=tuple(used))
            if self.dp_shard > 1 and self.tp > 1 and self.cp == 1:
                # FSDP × TP gradients' norms are partial over both: one all-reduce over the flattened pair
                # rather than two in turn (DTensor looks for it, and warns on every rank without it).
                mesh["dp_shard", "tp"]._flatten("dp_shard_tp")
            self._meshes[device_type] = mesh
        return self._meshes[device_type]

    def dp_mesh(self, device_type: str) -> DeviceMesh:
        """The data-parallel part of the world mesh a sharded strategy spreads the model over: one
        dimension of shards, or (replicate, shard) when there are copies too, the shard groups being
        consecutive data-parallel ranks (one node's, by default)."""
        mesh = self.world_mesh(device_type)
        shard = "dp_shard"
        if self.cp > 1 and "dp_shard" in (mesh.mesh_dim_names or ()):
            # The cp processes hold different tokens' gradients of the same samples: shards over them
            # too, so the reduce-scatter averages both (torchtitan's dp_shard_cp).
            mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
            shard = "dp_shard_cp"
        if self.dp_replicate > 1 and self.dp_shard > 1:
            return mesh["dp_replicate", shard]
        return mesh[shard if self.dp_shard > 1 or self.dp_replicate == 1 else "dp_replicate"]


def tp_sizes(parallel: ParallelConfig, world_size: int, local_world_size: int) -> list[int]:
    """The tensor-parallel sizes that factor a world of `world_size` processes, `local_world_size` per
    node, with the other sizes as set (tp × cp within a node when the job spans several)."""
    return [
        d
        for d in range(1, world_size + 1)
        if world_size % (d * parallel.pp_size * parallel.cp_size) == 0
        and (world_size <= local_world_size or local_world_size % (d * parallel.cp_size) == 0)
    ]
