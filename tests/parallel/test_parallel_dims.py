"""The dimensions of parallelism a job runs with, built from the config and the world size and checked
together: the data dimensions take what tensor, pipeline and context parallel leave."""

import pytest

from dtrain.config import load_config
from dtrain.errors import ConfigError
from dtrain.parallel.dims import ParallelDims, tp_sizes


@pytest.mark.parametrize(
    "overrides, world, local, dims",
    [
        ([], 4, 4, ParallelDims(dp_replicate=4)),
        (["parallel.strategy=fsdp"], 4, 2, ParallelDims(dp_shard=4)),
        (["parallel.strategy=hsdp"], 8, 4, ParallelDims(dp_replicate=2, dp_shard=4)),  # a node per group
        (
            ["parallel.strategy=hsdp", "parallel.hsdp_shard_size=2"],
            8,
            8,
            ParallelDims(dp_replicate=4, dp_shard=2),
        ),
    ],
)
def test_the_strategy_fills_its_dimensions_with_every_process(overrides, world, local, dims):
    built = ParallelDims.from_config(load_config(None, overrides).parallel, world, local)
    assert built == dims and built.world_size == world and (built.tp, built.pp) == (1, 1)


@pytest.mark.parametrize(
    "world, local, dims",
    [
        (8, 8, ParallelDims(dp_shard=2, pp=2, tp=2)),  # one node holds both stages: 2 data-parallel ranks each
        (16, 8, ParallelDims(dp_shard=4, pp=2, tp=2)),  # a node per stage
        (32, 8, ParallelDims(dp_replicate=2, dp_shard=4, pp=2, tp=2)),  # two nodes per stage
    ],
)
def test_hsdp_groups_a_nodes_data_parallel_ranks_of_one_stage_by_default(world, local, dims):
    """hsdp × pp × tp: the shard groups default to the data-parallel ranks one node holds of one stage."""
    overrides = ["parallel.strategy=hsdp", "parallel.pp_size=2", "parallel.tp_size=2"]
    assert ParallelDims.from_config(load_config(None, overrides).parallel, world, local) == dims


def test_shard_groups_that_do_not_divide_the_processes_are_refused_in_one_line():
    config = load_config(None, ["parallel.strategy=hsdp", "parallel.hsdp_shard_size=3"])
    with pytest.raises(ConfigError) as caught:
        ParallelDims.from_config(config.parallel, 4, 4)
    assert str(caught.value) == (
        "parallel.strategy = 'hsdp' shards over groups of 3 processes (parallel.hsdp_shard_size, "
        "default: the processes of one node) and 4 data-parallel processes do not divide into them; set "
        "parallel.hsdp_shard_size to a divisor of 4"
    )


@pytest.mark.parametrize(
    "overrides, world, local, dims",
    [
        (["parallel.tp_size=2"], 4, 4, ParallelDims(dp_replicate=2, tp=2)),
        (["parallel.strategy=fsdp", "parallel.tp_size=2"], 8, 4, ParallelDims(dp_shard=4, tp=2)),
        (["parallel.pp_size=2", "parallel.tp_size=2"], 8, 4, ParallelDims(dp_replicate=2, pp=2, tp=2)),
        # hsdp's default group: the data-parallel ranks of one node (4 processes, 2 per tp group)
        (["parallel.strategy=hsdp", "parallel.tp_size=2"], 8, 4, ParallelDims(dp_replicate=2, dp_shard=2, tp=2)),
    ],
)
def test_the_data_dimensions_take_what_the_model_splits_leave(overrides, world, local, dims):
    assert ParallelDims.from_config(load_config(None, overrides).parallel, world, local) == dims


def test_coordinates_put_tensor_parallel_peers_on_consecutive_ranks():
    dims = ParallelDims(pp=2, dp_replicate=2, tp=2)
    assert [dims.coordinate(r)["tp"] for r in range(8)] == [0, 1] * 4
    assert [dims.coordinate(r)["pp"] for r in range(8)] == [0] * 4 + [1] * 4
    # a replica's pipeline and tensor peers draw the same samples
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert dims.describe() == "pp 2 × dp 2 × tp 2"
    assert ParallelDims(dp_replicate=2, dp_shard=2, tp=2).describe() == "dp 2 × fsdp 2 × tp 2"
    assert ParallelDims(pp=2, tp=2).describe() == "pp 2 × dp 1 × tp 2"


@pytest.mark.parametrize(
    "overrides, world, local, message",
    [
        (
            ["parallel.tp_size=2", "parallel.pp_size=2"],
            6,
            6,
            "parallel.tp_size = 2 × parallel.pp_size = 2 splits the model over 4 processes and the job "
            "has 6; run a multiple of 4 processes (4, 8, 12, 16, ...) or set sizes whose product divides 6 "
            "(checkpoints resume under any layout)",
        ),
        (
            ["parallel.tp_size=2"],
            1,
            1,
            "parallel.tp_size = 2 splits the model over 2 processes and the job has 1; run a multiple of 2 "
            "processes (2, 4, 6, 8, ...) or set parallel.tp_size=1 (checkpoints resume under any layout)",
        ),
        (
            ["parallel.tp_size=4"],
            8,
            2,
            "parallel.tp_size × cp_size = 4 would span nodes of 2 processes (their all-gathers run every "
            "layer and need the node's fast links); use a divisor of 2, with FSDP or pipeline stages across "
            "the nodes",
        ),
    ],
)
def test_layouts_that_do_not_fit_the_world_are_refused_in_one_line(overrides, world, local, message):
    with pytest.raises(ConfigError) as caught:
        ParallelDims.from_config(load_config(None, overrides).parallel, world, local)
    assert str(caught.value) == message


def test_the_tensor_parallel_sizes_a_world_takes_leave_room_for_the_other_sizes_and_stay_in_a_node():
    assert tp_sizes(load_config(None, []).parallel, 6, 6) == [1, 2, 3, 6]
    assert tp_sizes(load_config(None, ["parallel.pp_size=2"]).parallel, 8, 8) == [1, 2, 4]
    assert tp_sizes(load_config(None, []).parallel, 16, 4) == [1, 2, 4]  # 8 and 16 would span nodes of 4
    assert tp_sizes(load_config(None, ["parallel.pp_size=3"]).parallel, 3, 3) == [1]


@pytest.mark.parametrize(
    "degrees, message",
    [
        ({"dp_shard": 0}, "the dp_shard degree of parallelism must be a whole number >= 1; got 0"),
        ({"dp_replicate": True}, "the dp_replicate degree of parallelism must be a whole number >= 1; got True"),
    ],
)
def test_degrees_are_checked_together(degrees, message):
    with pytest.raises(ConfigError) as caught:
        ParallelDims(**degrees)
    assert str(caught.value) == message
