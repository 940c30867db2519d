"""A user's script that fails on every rank, the way scripts fail: `failing_script.py crash|refuse`."""

import sys

import torch.distributed as dist

from dtrain.errors import DtrainError

dist.init_process_group("gloo")
rank = dist.get_rank()
dist.barrier()
if sys.argv[1] == "crash":
    raise RuntimeError(f"boom on rank {rank}")
raise DtrainError("data.path = 'nowhere' does not exist; give the folder of the shards")
