"""Worker: the mesh FSDP shards over under context parallel (dims.py), on 2 gloo processes: the cp
processes are folded into the shard dimension, so FSDP's reduce-scatter averages their gradients."""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from dtrain.parallel.dims import ParallelDims

dist.init_process_group("gloo")
rank = dist.get_rank()
found = {}
dims = ParallelDims(dp_shard=1, cp=2)  # distributed.strategy=fsdp, cp_size=2 on 2 processes
mesh = dims.dp_mesh("cpu")
found["fsdp"] = {"names": list(mesh.mesh_dim_names), "size": mesh.size(), "cp": dims.world_mesh("cpu")["cp"].size()}
if rank == 0:
    Path(sys.argv[1]).write_text(json.dumps(found))
dist.destroy_process_group()
