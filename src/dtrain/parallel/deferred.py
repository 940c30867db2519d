"""A model whose parameters were built on the meta device (models/empty.py), given memory only once FSDP
has sharded them: each rank then allocates its own shards and no more, and the weights a run starts from
(`model.init_from`, an `hf:` folder) fill them, each rank reading its rows of the file.

Before the strategy, only the buffers (real) go to the device. After `fully_shard`, `to_empty` allocates
each rank's shards, uninitialised: nothing is computed into memory the file then overwrites. It would
give the buffers new, empty memory too: they are put back as they were (a rotary `inv_freq`, a causal
mask: values computed when the model was built, in no file).

A parameter must never be left as that uninitialised memory: the weights must fill them all. The loader
refuses a file that misses any of the model's tensors (init_from.check_fit, in one line), and a resumed
run's checkpoint holds them all; without weights to start from, a model on the meta device is refused.
"""

from __future__ import annotations

import torch
from torch import nn

from dtrain.errors import ConfigError


def on_meta(module: nn.Module) -> bool:
    """Whether any of `module`'s parameters are on the meta device (memory still to be given)."""
    return any(p.is_meta for p in module.parameters())


def to_device(module: nn.Module, device: torch.device) -> None:
    """`module.to(device)`; for a model on the meta device, its buffers only (its parameters get memory
    once sharded: `materialise`)."""
    if not on_meta(module):
        module.to(device)
        return
    for sub in module.modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None:
                sub._buffers[name] = buffer.to(device)


def check(module: nn.Module, sharded: bool, weights_given: bool) -> None:
    """Refuse a model on the meta device that the strategy will not shard, or that no weights will fill."""
    if not on_meta(module):
        return
    names = [name for name, p in module.named_parameters() if p.is_meta][:3]
    if not sharded:
        raise ConfigError(
            f"the model's parameters ({', '.join(names)}, ...) are on the meta device, and only "
            f"parallel.strategy = fsdp or hsdp on 2 or more processes gives them memory; build the model "
            f"on a real device"
        )
    if not weights_given:
        raise ConfigError(
            f"the model's parameters ({', '.join(names)}, ...) are on the meta device and no weights fill them; "
            f"give model.init_from, or build the model on a real device"
        )


def materialise(module: nn.Module, device: torch.device) -> None:
    """Give the (sharded) parameters of a model on the meta device memory on `device`, uninitialised,
    keeping its buffers as they are."""
    if not on_meta(module):
        return
    buffers = [(sub, name, b) for sub in module.modules() for name, b in sub._buffers.items() if b is not None]
    module.to_empty(device=device)
    for sub, name, buffer in buffers:
        sub._buffers[name] = buffer
