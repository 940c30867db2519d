"""The dimensions of parallelism a job runs with, built from the config and the world size and checked
together; tensor and pipeline parallel are present at degree 1 and refused above it."""

import pytest

from dtrain.config import load_config
from dtrain.errors import ConfigError
from dtrain.parallel.dims import ParallelDims


@pytest.mark.parametrize(
    "overrides, world, local, dims",
    [
        ([], 4, 4, ParallelDims(dp_replicate=4)),
        (["distributed.strategy=fsdp"], 4, 2, ParallelDims(dp_shard=4)),
        (["distributed.strategy=hsdp"], 8, 4, ParallelDims(dp_replicate=2, dp_shard=4)),  # a node per group
        (
            ["distributed.strategy=hsdp", "distributed.hsdp_shard_size=2"],
            8,
            8,
            ParallelDims(dp_replicate=4, dp_shard=2),
        ),
    ],
)
def test_the_strategy_fills_its_dimensions_with_every_process(overrides, world, local, dims):
    built = ParallelDims.from_config(load_config(None, overrides), world, local)
    assert built == dims and built.world_size == world and (built.tp, built.pp) == (1, 1)


def test_shard_groups_that_do_not_divide_the_processes_are_refused_in_one_line():
    config = load_config(None, ["distributed.strategy=hsdp", "distributed.hsdp_shard_size=3"])
    with pytest.raises(ConfigError) as caught:
        ParallelDims.from_config(config, 4, 4)
    assert str(caught.value) == (
        "distributed.strategy = 'hsdp' shards over groups of 3 processes (distributed.hsdp_shard_size, "
        "default: the processes of one node) and 4 processes do not divide into them; set "
        "distributed.hsdp_shard_size to a divisor of 4"
    )


@pytest.mark.parametrize(
    "degrees, message",
    [
        ({"tp": 2}, "tensor parallel (tp = 2) is not yet supported: dtrain spreads data only; use tp = 1"),
        ({"pp": 4}, "pipeline parallel (pp = 4) is not yet supported: dtrain spreads data only; use pp = 1"),
        ({"dp_shard": 0}, "the dp_shard degree of parallelism must be a whole number >= 1; got 0"),
        ({"dp_replicate": True}, "the dp_replicate degree of parallelism must be a whole number >= 1; got True"),
    ],
)
def test_degrees_are_checked_together(degrees, message):
    with pytest.raises(ConfigError) as caught:
        ParallelDims(**degrees)
    assert str(caught.value) == message
