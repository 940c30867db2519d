"""Run under torchrun (2 processes): the built-in GPT with dropout split over tp 2, the masks its
dropout draws on each rank's shard, with and without dropout's own stream per tp rank.

    torchrun --standalone --nproc-per-node 2 tp_dropout.py OUT_DIR

Rank 0 writes OUT_DIR/masks.json: for each case, every rank's masks (which elements each hooked dropout
zeroed) as lists.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from dtrain.distributed import end_worker_process
from dtrain.models.gpt import GPT
from dtrain.parallel import dropout, tensor


def masks(own_streams: bool, shards_said: bool = True) -> dict[str, list]:
    torch.manual_seed(0)
    model = GPT(vocab_size=64, block_size=8, n_layer=1, n_head=4, n_embd=16, dropout=0.5)
    if not shards_said:  # a model that does not say its dropout acts on shards
        model.tp_dropout_on_shards = False  # type: ignore[misc]
    tensor.parallelize(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))["tp"])
    if own_streams:
        dropout.own_streams(model, dist.get_rank())
    seen: dict[str, list] = {}
    for name in ("drop", "h.0.mlp.dropout"):
        model.get_submodule(name).register_forward_hook(
            lambda _m, _i, out, name=name: seen.__setitem__(name, (out == 0).int().flatten().tolist())
        )
    model.train()
    model(torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1)))
    return seen


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    cases = {
        "shared": masks(own_streams=False),
        "own": masks(own_streams=True),
        "own_again": masks(own_streams=True),
        "not_said": masks(own_streams=True, shards_said=False),
    }
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, cases)
    if dist.get_rank() == 0:
        (out / "masks.json").write_text(json.dumps(gathered))
    # Out as dtrain's own workers end, without the interpreter's teardown: gloo's thread, still
    # dropping a finished collective's tensors as Python tore down, aborted a finished rank
    # ("terminate called without an active exception", about one run in eight on a busy machine).
    dist.barrier()
    dist.destroy_process_group()
    end_worker_process(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
