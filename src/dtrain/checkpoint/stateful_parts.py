"""The parts of a checkpoint whose state is a state_dict of the object's own: the schedule, the GradScaler,
every object registered with Trainer.register_for_checkpointing, each rank's own state, and the RNG.
Their tensors go through DCP under the part's name; the rest into trainer.json as JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dtrain.checkpoint.part import Part, Saved, is_rate
from dtrain.checkpoint.rng import load_rng, save_rng
from dtrain.checkpoint.store import CheckpointError
from dtrain.files import fsync_file


class StatefulPart(Part):
    """An object with state_dict() / load_state_dict() (torch's Stateful): its tensors through DCP, under
    "<name>.<key>…" as nested in its state dict, the rest as JSON. Its state_dict() before the resume
    names the tensors to read back, as the model's does."""

    def __init__(self, name: str, obj: Any):
        super().__init__(name)
        self.obj = obj

    def capture(self) -> tuple[dict[str, Any], Any]:
        state = self.obj.state_dict()
        if not isinstance(state, dict):
            raise CheckpointError(
                f"part '{self.name}' (register_for_checkpointing) gave a state_dict() of "
                f"{type(state).__name__}, not a dict; return a dict of tensors and JSON values"
            )
        tensors, rest = _split(self.name, (), state)
        return tensors or {}, rest

    def problem(self, entry: Any) -> str | None:
        return None if isinstance(entry, dict) else f"its {self.name} entry is not an object"

    def targets(self, saved: Saved) -> dict[str, Any]:
        tensors = _split(self.name, (), self.obj.state_dict(), judge=False)[0] or {}
        for path in _paths(tensors):
            if ".".join((self.name, *path)) not in saved.tensors:
                raise CheckpointError(
                    f"checkpoint {saved.name} holds no '{'.'.join(path)}' of part '{self.name}', which this "
                    f"run's {self.name} has; resume with the {self.name} the checkpoint was written with, or "
                    f"start a new run.dir"
                )
        return tensors

    def restore(self, saved: Saved, tensors: dict[str, Any]) -> None:
        self.obj.load_state_dict(_merge(saved.trainer.get(self.name, {}), tensors))

    def unfit(self, saved: Saved, exc: BaseException) -> str:
        return (
            f"checkpoint {saved.name}'s part '{self.name}' does not fit this run's {self.name} "
            f"({type(exc).__name__}: {exc}); resume with the {self.name} the checkpoint was written with, or "
            f"start a new run.dir"
        )


class SchedulePart(StatefulPart):
    """The learning-rate schedule (JSON only), its numbers judged before it is loaded."""

    def problem(self, entry: Any) -> str | None:
        if not isinstance(entry, dict):
            return "its scheduler entry is not an object"
        for key in ("last_epoch", "_step_count"):
            value = entry.get(key, 0)
            if not (isinstance(value, int) and not isinstance(value, bool) and -1 <= value < 2**53):
                return f"scheduler {key} is {value!r}, not a whole number"
        for key in ("base_lrs", "_last_lr"):
            if not (isinstance(entry.get(key, []), list) and all(is_rate(v) for v in entry.get(key, []))):
                return f"scheduler {key} is {entry.get(key)!r}, not a list of finite numbers >= 0"
        return None

    def unfit(self, saved: Saved, exc: BaseException) -> str:
        return Part.unfit(self, saved, exc)


class ScalerPart(StatefulPart):
    """GradScaler's scale and growth tracker; a disabled scaler's state is empty, and there is nothing to load."""

    def restore(self, saved: Saved, tensors: dict[str, Any]) -> None:
        if saved.trainer.get(self.name):
            super().restore(saved, tensors)

    def unfit(self, saved: Saved, exc: BaseException) -> str:
        return Part.unfit(self, saved, exc)


_ABSENT = object()  # no JSON value at this key (all of it tensors)


def _split(part: str, path: tuple[str, ...], value: Any, judge: bool = True) -> tuple[Any, Any]:
    """(the tensors in `value`, nested as there, or None; the rest, or _ABSENT). `judge`: a value that is
    neither a tensor nor JSON is refused, naming the part and key."""
    where = f"part '{part}'" + (f" key '{'.'.join(path)}'" if path else "")
    if isinstance(value, torch.Tensor):
        return value, _ABSENT
    if isinstance(value, dict) and _holds_tensor(value):
        tensors, rest = {}, {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise CheckpointError(f"{where} has key {key!r} over tensors: checkpoints name tensors by strings")
            inner, leftover = _split(part, (*path, key), item, judge)
            if inner is not None:
                tensors[key] = inner
            if leftover is not _ABSENT:
                rest[key] = leftover
        return tensors, rest
    if judge and _holds_tensor(value):
        raise CheckpointError(
            f"{where} is {type(value).__name__} holding tensors; keep a part's tensors in dicts, by name, "
            f"to checkpoint them"
        )
    if judge:
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(
                f"{where} is neither a tensor nor JSON ({exc}); make its state_dict() hold tensors, "
                f"numbers, strings, lists and dicts only"
            ) from None
    return None, value


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False


def _paths(tensors: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = []
    for key, value in tensors.items():
        if isinstance(value, dict):
            found.extend(_paths(value, (*prefix, key)))
        else:
            found.append((*prefix, key))
    return found


def _merge(rest: Any, tensors: dict[str, Any]) -> Any:
    merged = dict(rest) if isinstance(rest, dict) else {}
    for key, value in tensors.items():
        merged[key] = _merge(merged.get(key), value) if isinstance(value, dict) else value
    return merged


class RankStatePart(Part):
    """State that differs from rank to rank (an iterable data set's position in the rank's share), marked
    `per_rank = True` on its object: JSON in a file of each rank's own, <name>-rank<R>.json, taken when the
    checkpoint is staged. Such data cannot continue on another number of processes (see state.regroup)."""

    def __init__(self, name: str, obj: Any, rank: int):
        super().__init__(name)
        self.obj, self.rank = obj, rank
        self.taken: Any = None

    def _path(self, folder: Path) -> Path:
        return folder / f"{self.name}-rank{self.rank}.json"

    def capture(self) -> tuple[dict[str, Any], Any]:
        self.taken = json.dumps(self.obj.state_dict())
        return {}, None

    def write_files(self, folder: Path) -> None:
        self._path(folder).write_text(self.taken)
        fsync_file(self._path(folder))

    def targets(self, saved: Saved) -> dict[str, Any]:
        if not self._path(saved.folder).is_file():
            raise CheckpointError(
                f"{self._path(saved.folder)} is missing; delete {saved.folder} to resume from an earlier checkpoint"
            )
        return {}

    def restore(self, saved: Saved, tensors: dict[str, Any]) -> None:
        self.obj.load_state_dict(json.loads(self._path(saved.folder).read_text()))

    def unfit(self, saved: Saved, exc: BaseException) -> str:
        return (
            f"{self._path(saved.folder)} cannot be read back ({type(exc).__name__}: {exc}); delete {saved.folder} "
            f"to resume from an earlier checkpoint"
        )


# --- RNG ----------------------------------------------------------------------------------------------


class RngPart(Part):
    """Each rank's RNG states, in a file of its own (rng-rank<R>.safetensors). On another number of
    processes rank r continues rank (r mod N)'s random streams (dropout): the run goes on from the same
    data position, but not bitwise as at the same world size."""

    def __init__(self, rank: int, device: torch.device):
        super().__init__("rng")
        self.rank, self.device = rank, device

    def write_files(self, folder: Path) -> None:
        save_rng(folder / f"rng-rank{self.rank}.safetensors", self.device)

    def _path(self, saved: Saved) -> Path:
        return saved.folder / f"rng-rank{self.rank % saved.trainer['world_size']}.safetensors"

    def targets(self, saved: Saved) -> dict[str, Any]:
        if not self._path(saved).is_file():
            raise CheckpointError(
                f"{self._path(saved)} is missing; delete {saved.folder} to resume from an earlier checkpoint"
            )
        return {}

    def restore(self, saved: Saved, tensors: dict[str, Any]) -> None:
        load_rng(self._path(saved), self.device, saved.format)

    def unfit(self, saved: Saved, exc: BaseException) -> str:
        return (
            f"{self._path(saved)} cannot be read ({type(exc).__name__}: {exc}); delete {saved.folder} to "
            f"resume from an earlier checkpoint"
        )
