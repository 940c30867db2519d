"""Worker: the mesh FSDP shards over under context parallel (dims.py), on 2 gloo processes: the cp
processes are folded into the shard dimension, so FSDP's reduce-scatter averages their gradients."""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from dtrain.parallel.dims import ParallelDims

dist.init_process_group("gloo")
rank = dist.get_rank()
found = {}
dims = ParallelDims(dp_shard=1, cp=2)  # parallel.strategy=fsdp, cp_size=2 on 2 processes
mesh = dims.dp_mesh("cpu")
found["fsdp"] = {"names": list(mesh.mesh_dim_names), "size": mesh.size(), "cp": dims.world_mesh("cpu")["cp"].size()}
# The check that the cp processes hold the same batches (context.py), on the cp dimension's group.
import torch  # noqa: E402

from dtrain.parallel.context import same_on_every_rank  # noqa: E402

cp = dims.world_mesh("cpu")["cp"]
window = torch.arange(12).view(2, 6)
same = [window[:, :-1], window[:, 1:]]
swapped = [window[:, 1:], window[:, :-1]] if rank else same  # the same numbers, in another order
found["same"] = same_on_every_rank(same, cp)
found["other"] = same_on_every_rank([window + rank, window], cp)
found["swapped"] = same_on_every_rank(swapped, cp)
if rank == 0:
    Path(sys.argv[1]).write_text(json.dumps(found))
# gloo aborted a rank once at the end ("terminate called without an active exception": its threads
# still dropping a collective's tensors while the interpreter tore down). Both ranks done with every
# group first, then out without the interpreter's teardown, as dtrain's own workers end.
dist.barrier()
dist.destroy_process_group()
os._exit(0)
