"""The end of a run: the trained weights as `model.safetensors`, loadable without pickle."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from dtrain.files import atomic_write
from dtrain.rundir import WEIGHTS_MARK


def save_final_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    """The trained weights (a full state dict on the CPU) as safetensors, loadable without pickle,
    written atomically. Tensors stored once under several names (tied embeddings) are written once,
    under the first name in sorted order, the others noted in the metadata: what safetensors'
    `save_model` does, so `load_model` reads the file back into the model."""
    metadata = dict(WEIGHTS_MARK)
    unique: dict[str, torch.Tensor] = {}
    kept: dict[tuple[int, int], str] = {}
    for name in sorted(state):
        tensor = state[name]
        where = (tensor.untyped_storage().data_ptr(), tensor.storage_offset()) if tensor.numel() else (0, id(tensor))
        if where in kept and state[kept[where]].shape == tensor.shape:
            metadata.setdefault(name, kept[where])
            continue
        kept[where] = name
        unique[name] = tensor.contiguous()
    atomic_write(path, lambda tmp: save_file(unique, tmp, metadata=metadata))
