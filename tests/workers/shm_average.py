"""Run under torchrun with 3 processes: dtrain's shared-memory average on its own, rank against rank.

    torchrun --standalone --nproc-per-node 3 shm_average.py OUT_DIR

At 3 ranks the order of a floating-point sum changes its result, so this is where "every rank gets
bitwise the same numbers" can break. Rank 0 writes OUT_DIR/results.json.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dtrain.distributed import end_worker_process
from dtrain.parallel.ddp_comm import SharedMemoryAllReduce


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = torch.nn.Linear(100, 100)  # sizes the shared slots
    state = SharedMemoryAllReduce.create(model, rank, world, world, timeout_s=60)
    g = torch.Generator().manual_seed(rank)
    mine = torch.randn(10_000, generator=g) * 10 ** torch.randint(-3, 4, (10_000,), generator=g)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    averaged = state.average(mine.clone())
    results = [torch.empty_like(averaged) for _ in range(world)]
    dist.all_gather(results, averaged)
    if rank == 0:
        mean = torch.stack(everyone).double().mean(0)
        (out / "results.json").write_text(
            json.dumps(
                {
                    "used_shared_memory": state is not None,
                    "ranks_bitwise_equal": all(torch.equal(results[0], r) for r in results[1:]),
                    "max_error_vs_float64_mean": float((results[0].double() - mean).abs().max()),
                    "largest_value": float(mean.abs().max()),
                }
            )
        )
    # Out as dtrain's own workers end, without the interpreter's teardown: gloo's thread, still
    # dropping a finished collective's tensors as Python tore down, aborted a finished rank
    # ("terminate called without an active exception", about one run in eight on a busy machine).
    dist.barrier()
    dist.destroy_process_group()
    end_worker_process(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
