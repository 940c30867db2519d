"""Dropout's random stream per tensor-parallel rank.

Every rank seeds torch's generators alike (the same initial weights everywhere). Under tensor parallel
that is wrong for dropout acting on a shard: the tp ranks of a replica would draw one mask pattern for
different positions (sequence parallel) or different heads (attention), so the masks of the whole
activation repeat with the shard. torch's DTensor random streams do not help: dropout runs on the local
tensors, and DTensor's RNG tracker works on CUDA alone. So after the split, each tp rank but the first
moves onto a stream of its own. Only a model that says all of its dropout acts on shards under its plan
(`tp_dropout_on_shards`, the built-in GPT) is moved: dropout on replicated activations (a Hugging Face
plan without sequence parallel, a plan given in code) must draw the same mask on every tp rank.

The streams are each rank's generator state, so checkpoints (which keep every rank's) resume them
bitwise; the data never draws from them (the samplers have generators of their own).
"""

from __future__ import annotations

import torch
from torch import nn

from dtrain.parallel.model_hooks import offered

# Far apart, so tp rank r's stream is not another run's (seed + r) stream.
_STRIDE = 1_000_003


def own_streams(module: nn.Module, tp_rank: int) -> bool:
    """Move this process's dropout onto tp rank `tp_rank`'s stream where `module` asks for it (rank 0
    keeps the stream one process would draw); whether it moved."""
    if tp_rank == 0 or not offered(module).tp_dropout_on_shards:
        return False
    torch.manual_seed(torch.initial_seed() + _STRIDE * tp_rank)  # CPU and every CUDA device
    return True
