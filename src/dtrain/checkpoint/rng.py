"""Each rank's RNG states (torch, CUDA, numpy, python), in a safetensors file of its own: no pickle."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dtrain.checkpoint.formats import CURRENT, FLAT_NAMES
from dtrain.files import fsync_file, user_file_mode


def device_of(module: nn.Module) -> torch.device:
    return next(module.parameters(), torch.empty(0)).device


def save_rng(path: Path, device: torch.device) -> None:
    """This rank's RNG states; on a GPU, that of the device the rank computes on (and no other: a
    rank's draws on its own GPU are the only ones a resume must repeat)."""
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    tensors = {
        "torch": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
        "python_state": torch.tensor(py_state, dtype=torch.int64),
    }
    if device.type == "cuda":
        tensors["cuda"] = torch.cuda.get_rng_state(device)
    metadata = {
        "numpy": json.dumps([np_kind, np_pos, np_has_gauss, np_gauss]),
        "python": json.dumps([py_version, py_gauss]),
    }
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, user_file_mode())  # safetensors writes 0600
    fsync_file(path)


def load_rng(path: Path, device: torch.device, checkpoint_format: int = CURRENT) -> None:
    from safetensors import safe_open

    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as fh:
        metadata = fh.metadata()
    torch.set_rng_state(tensors["torch"])
    np_kind, np_pos, np_has_gauss, np_gauss = json.loads(metadata["numpy"])
    np.random.set_state((np_kind, tensors["numpy_keys"].numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss))
    py_version, py_gauss = json.loads(metadata["python"])
    random.setstate((py_version, tuple(tensors["python_state"].tolist()), py_gauss))
    state = None
    if device.type == "cuda":
        state = tensors.get("cuda")
        if checkpoint_format == FLAT_NAMES and state is None:  # the earliest kept every visible GPU's as cuda_<i>
            state = tensors.get(f"cuda_{device.index}")
    if state is not None:
        torch.cuda.set_rng_state(state, device)
