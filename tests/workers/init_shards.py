"""What reading weights into an FSDP-sharded model costs each rank, measured by the kernel.

    torchrun --nproc-per-node 2 tests/workers/init_shards.py WEIGHTS OUT [FROM]

WEIGHTS is a model.safetensors of `model()`, or a GPT-2 folder exported from one, FROM (its Conv1D weights
stored transposed: a rank's rows of them are columns of the file's). Each rank writes OUT/rank<R>.json:
the bytes it read (the kernel's count, /proc/self/io) and how far its peak resident memory rose (VmHWM)
while `model.init_from`'s loader read WEIGHTS into its FSDP shards; the same for a whole, unsharded copy
of the model (what one rank reading everything costs); and whether the shards then hold the tensors.
"""

import json
import sys
from pathlib import Path

import torch

import dtrain
from dtrain import distributed, parallel
from dtrain.checkpoint import init_from
from dtrain.export.weights import load_weights
from dtrain.models.gpt import GPT
from dtrain.parallel.options import StrategyOptions


def model() -> GPT:
    """About 25 MB of fp32 weights in many matrices of at most 1 MB: what a rank reads shows, not the
    one tensor's slice it holds for a moment before copying it into its shard."""
    return GPT(vocab_size=512, block_size=64, n_layer=8, n_head=4, n_embd=256)


def status_kib(key: str) -> int:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(key + ":"))
    return int(line.split()[1])


def bytes_read() -> int:
    """What this process has read with read(2) and its kind, as the kernel counts it."""
    return int(next(line for line in Path("/proc/self/io").read_text().splitlines() if line.startswith("rchar:"))[6:])


def cost(load) -> dict[str, int]:
    """The bytes `load()` read, and how far it raised the peak RSS (the kernel's high-water mark, reset
    just before)."""
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from the current RSS
    peak, read = status_kib("VmHWM"), bytes_read()
    load()
    return {"read": bytes_read() - read, "peak": (status_kib("VmHWM") - peak) * 1024}


def main() -> None:
    weights, out = sys.argv[1], Path(sys.argv[2])
    config = dtrain.load_config(None, ["parallel.strategy=fsdp", f"run.dir={out / 'run'}"])
    with distributed.session(config.distributed) as session:
        torch.manual_seed(1)  # other weights than the file's
        sharded, whole = model(), model()
        options, dims = StrategyOptions.of(config), parallel.layout(config, session)
        parallel.build(options, session, sharded, None, dims)  # FSDP2: each rank keeps its rows
        source = init_from.resolve("model.init_from", weights)
        sharded_cost = cost(lambda: init_from.load_into(sharded, source, session.is_main))
        whole_cost = cost(lambda: init_from.load_into(whole, source, session.is_main))
        expected = load_weights(sys.argv[3] if len(sys.argv) > 3 else weights)  # tied tensors under each name
        full = {name: tensor.full_tensor() for name, tensor in sharded.state_dict().items()}
        same = all(torch.equal(full[name], expected[name]) for name in full)
        facts = {"sharded": sharded_cost, "whole": whole_cost, "same": same}
        (out / f"rank{session.rank}.json").write_text(json.dumps(facts))


if __name__ == "__main__":
    main()
