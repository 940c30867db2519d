"""The end of a run: the trained weights as `model.safetensors`, loadable without pickle — or, where
they cannot be written, kept in a checkpoint or rescued to another disk, and the run says where."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from dtrain import distributed
from dtrain.checkpoint.store import CheckpointError
from dtrain.errors import DtrainError
from dtrain.files import atomic_write
from dtrain.rundir import END_OF_RUN, WEIGHTS_MARK

if TYPE_CHECKING:
    from dtrain.checkpoint.checkpointer import Checkpointer


def save_final_weights(state: dict[str, torch.Tensor], path: Path, end: dict[str, Any] | None = None) -> None:
    """The trained weights (a full state dict on the CPU) as safetensors, loadable without pickle,
    written atomically. Tensors stored once under several names (tied embeddings) are written once,
    under the first name in sorted order, the others noted in the metadata: what safetensors'
    `save_model` does, so `load_model` reads the file back into the model. `end`: what the run that
    ends here planned and reached (rundir.weights_end reads it back)."""
    metadata = dict(WEIGHTS_MARK)
    if end is not None:
        metadata[END_OF_RUN] = json.dumps(end)
    unique: dict[str, torch.Tensor] = {}
    kept: dict[tuple[int, int], str] = {}
    for name in sorted(state):
        tensor = state[name]
        where = (
            (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset())) if tensor.numel() else (0, id(tensor))
        )
        if where in kept and state[kept[where]].shape == tensor.shape:
            metadata.setdefault(name, kept[where])
            continue
        kept[where] = name
        unique[name] = tensor.contiguous()
    atomic_write(path, lambda tmp: save_file(unique, tmp, metadata=metadata))


def load_weights(path: str | Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The weights in a `model.safetensors` dtrain wrote, under every name the model's state dict has:
    a tensor tied under several names (GPT-2's lm_head and wte) is stored once and comes back under
    each, so `model.load_state_dict(load_weights(path))` is strict. A one-line error for a file that
    is missing or not safetensors."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device=device) as weights:
            state = {name: weights.get_tensor(name) for name in weights.keys()}  # noqa: SIM118 — not a dict
            metadata = weights.metadata() or {}
    except (OSError, SafetensorError) as exc:
        raise DtrainError(f"{path} cannot be read as safetensors weights ({exc}); give a model.safetensors") from None
    for name, stored_as in metadata.items():  # save_final_weights noted each other name of a tied tensor
        if name not in state and stored_as in state:
            state[name] = state[stored_as]
    return state


def write_final_weights(
    state: dict[str, torch.Tensor] | None,
    path: Path,
    is_main: bool,
    checkpointer: Checkpointer,
    step: int,
    save_checkpoint: Callable[[], None],
) -> None:
    """model.safetensors: the end of the run, its most valuable moment. Rank 0 writes `state` (the whole
    model, which only it holds). If the weights cannot be written (a full disk, a directory in the way),
    the trained state is kept in a checkpoint (`save_checkpoint()` writes one unless the last step has
    one) and the run says where, exit 2 — never a finished run with nothing to show."""
    parts = checkpointer.parts
    end = {"step": step, "plan": parts.plan, "identity": parts.identity, "data_ranks": parts.data_world}
    error = distributed.rank0_decides(lambda: _write_error(state, path, end), is_main=is_main)
    if error is None:
        if checkpointer.config.export == "hf":  # from the file just written: the state is not gathered twice
            distributed.rank0_decides(lambda: export_at_the_end(path.parent), is_main=is_main)
        return
    if checkpointer.last_saved_step != step:
        try:
            save_checkpoint()
        except CheckpointError as exc:
            # run.dir's disk is full: the last resort is the system's temporary folder (often another disk).
            rescued = distributed.from_rank0(rescue_weights(state) if is_main and state is not None else None)
            kept = (
                f"the trained weights are safe in {rescued}: copy them to {path} once there is room"
                if rescued
                else "and no copy of the weights could be written anywhere else either"
            )
            raise DtrainError(
                f"could not write {path} ({error}), nor a checkpoint of the trained state ({exc}); {kept}"
            ) from None
    raise DtrainError(
        f"could not write {path} ({error}); the trained state is safe in {checkpointer.store.root}/step-{step}: "
        f"make room (or move what is in the way) and rerun the same command to write the weights"
    )


def export_at_the_end(run_dir: Path) -> None:
    """checkpoint.export = "hf": run.dir/hf from the final weights just written (rank 0). A failure leaves the
    weights as they are and says how to export them again."""
    from dtrain.export.hf import export_hf

    try:
        export_hf(run_dir)
    except (DtrainError, OSError) as exc:
        raise DtrainError(
            f"the run's weights are in {run_dir / 'model.safetensors'}, and their Hugging Face export "
            f"(checkpoint.export = hf) could not be written ({exc}); export them with: dtrain export {run_dir} "
            f"--format hf"
        ) from None


def _write_error(state: dict[str, torch.Tensor] | None, path: Path, end: dict[str, Any]) -> str | None:
    """Why `state` could not be written to `path`, or None once it is."""
    assert state is not None, "rank 0 holds the full state dict"
    try:
        save_final_weights(state, path, end)
    except Exception as exc:
        error = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).strip()
        if "No space left on device" in error:  # safetensors wraps it: "I/O error: ... (os error 28)"
            error = "No space left on device"
        return error
    return None


def rescue_weights(state: dict[str, torch.Tensor]) -> str | None:
    """model.safetensors in a new folder of the first place with room: the system's temporary folder,
    /dev/shm (memory), the home folder, the current folder. Where it went, or None."""
    for place in dict.fromkeys([tempfile.gettempdir(), "/dev/shm", str(Path.home()), os.getcwd()]):
        folder = None
        try:
            folder = Path(tempfile.mkdtemp(prefix="dtrain-rescued-weights-", dir=place))
            save_final_weights(state, folder / "model.safetensors")
            return str(folder / "model.safetensors")
        except Exception:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
    return None
