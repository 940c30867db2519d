"""The named parts of a checkpoint, each captured and put back by one small adapter.

A part's tensors go through DCP under its name ("<part>.<key>", resharded as the model's are); its other
values go into trainer.json under its name, as JSON (no pickle in a checkpoint). The model, optimizer,
schedule, GradScaler and RNG are parts like any registered one (Trainer.register_for_checkpointing: an
EMA of the weights, a stateful data set, a communication hook's error feedback), so adding one is a
registration, not an edit of the save, the load and the schema check.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from dtrain.checkpoint.part import Part, Saved, is_number, is_rate
from dtrain.checkpoint.rng import device_of
from dtrain.checkpoint.state import BUILT_IN_PARTS, Parts
from dtrain.checkpoint.stateful_parts import RankStatePart, RngPart, ScalerPart, SchedulePart, StatefulPart
from dtrain.checkpoint.store import CheckpointError
from dtrain.parallel.base import StageNames

_IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")


def adapters(parts: Parts) -> dict[str, Part]:
    """Every part of `parts`, in the order they are put back (RNG last: nothing may draw after it)."""
    found: dict[str, Part] = {
        "model": ModelPart(parts.module, parts.stage),
        "optimizer": OptimizerPart(parts.module, parts.optimizer, parts.stage),
        "scheduler": SchedulePart("scheduler", parts.scheduler),
        "scaler": ScalerPart("scaler", parts.scaler),
    }
    for name, obj in parts.extra.items():
        per_rank = getattr(obj, "per_rank", False) is True  # state that differs by rank says so
        found[name] = RankStatePart(name, obj, parts.rank) if per_rank else StatefulPart(name, obj)
    found["rng"] = RngPart(parts.rank, device_of(parts.module))
    assert set(BUILT_IN_PARTS) <= set(found)
    return found


# --- model and optimizer ----------------------------------------------------------------------------


class ModelPart(Part):
    """The model's tensors, as DCP's own view of them ("model.<fqn>"): replicas written once, FSDP's shards
    by their owners, read back as this run places and shards them. A LoRA model's: only what trains (its
    adapters; the frozen base is rebuilt from its reference on resume, models/lora.py)."""

    def __init__(self, module: torch.nn.Module, stage: StageNames | None = None):
        from dtrain.models import lora

        super().__init__("model")
        self.module, self.stage = module, stage
        adapted = lora.of(module) is not None
        self.options = StateDictOptions(ignore_frozen_params=adapted)
        # Every name of a frozen parameter: DCP drops a tied one (a head tied to its embedding) under its
        # first name only.
        named = module.named_parameters(remove_duplicate=False) if adapted else ()
        self.frozen = {name for name, param in named if not param.requires_grad}

    def _state(self) -> dict[str, Any]:
        state = get_model_state_dict(self.module, options=self.options)
        return {name: value for name, value in state.items() if name not in self.frozen}

    def capture(self) -> tuple[dict[str, Any], Any]:
        return self._state(), None

    def targets(self, saved: Saved) -> dict[str, Any]:
        state = self._state()
        # A pipeline stage holds part of the model: the checkpoint's other names are the other stages'.
        _check_model(saved, state, self.stage.whole if self.stage else frozenset())
        return state

    def restore(self, saved: Saved, tensors: dict[str, Any]) -> None:
        # Not strict: the model's keys and shapes were checked in targets.
        set_model_state_dict(self.module, tensors, options=StateDictOptions(strict=False))


def _check_model(saved: Saved, model_state: dict[str, Any], elsewhere: frozenset[str] = frozenset()) -> None:
    prefix = "model/" if saved.flat else "model."
    saved_model = {k[len(prefix) :]: item for k, item in saved.tensors.items() if k.startswith(prefix)}
    for key, tensor in model_state.items():
        item = saved_model.get(key)
        if item is None:
            raise CheckpointError(
                f"checkpoint {saved.name} has no '{key}' for this run's model; resume "
                f"with the model the checkpoint was trained with, or start a new run.dir"
            )
        if not isinstance(item, TensorStorageMetadata) or list(item.size) != list(tensor.shape):
            shape = list(item.size) if isinstance(item, TensorStorageMetadata) else "not a tensor"
            raise CheckpointError(
                f"checkpoint {saved.name} holds '{key}' of shape {shape} and this run's "
                f"model has {list(tensor.shape)}; resume with the model settings the "
                f"checkpoint was trained with, or start a new run.dir"
            )
    extra = sorted(set(saved_model) - set(model_state) - elsewhere)
    if extra:
        raise CheckpointError(
            f"checkpoint {saved.name} holds '{extra[0]}', which this run's model lacks; "
            f"resume with the same model, or start a new run.dir"
        )


PerParameter = dict[str, dict[str, Any]]  # an optimizer's state: {parameter fqn: {name: value}}


def split_tensors(state: PerParameter) -> tuple[PerParameter, PerParameter]:
    """An optimizer's per-parameter state split into its tensors (for DCP) and the rest (for trainer.json,
    as JSON: no pickle in a checkpoint)."""
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    rest: dict[str, dict[str, Any]] = {}
    for fqn, values in state.items():
        for name, value in values.items():
            side = tensors if isinstance(value, torch.Tensor) else rest
            side.setdefault(fqn, {})[name] = value
    return tensors, rest


class OptimizerPart(Part):
    """The optimizer's per-parameter tensors through DCP ("optimizer.state.<fqn>.<name>"), its groups and
    other values in trainer.json."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, stage: StageNames | None = None):
        super().__init__("optimizer")
        self.module, self.optimizer, self.stage = module, optimizer, stage
        self.saved_any = True
        self.renamed: dict[str, str] = {}  # the name a tied parameter's state was saved by: its name here

    def capture(self) -> tuple[dict[str, Any], Any]:
        untouched = not self.optimizer.state  # no update applied yet (fp16 may skip the first steps)
        state: dict[str, Any] = dict(get_optimizer_state_dict(self.module, self.optimizer))
        if untouched:
            # DCP fills an empty optimizer by taking a step at lr 0 (AdamW's step count becomes 1, and
            # bias correction would differ from a run that never saved): undo that, save it empty.
            self.optimizer.state.clear()
            state["state"] = {}
        tensors, leftovers = split_tensors(state["state"])
        return {"state": tensors}, {"param_groups": state["param_groups"], "state": leftovers}

    def problem(self, entry: Any) -> str | None:
        return _optimizer_problem(entry)

    def targets(self, saved: Saved) -> dict[str, Any]:
        def key(fqn: str, name: str) -> str:
            return f"optimizer/{fqn}/{name}" if saved.flat else f"optimizer.state.{fqn}.{name}"

        # Only what the checkpoint holds: DCP's zero-lr step gives every parameter optimizer state, and one
        # that never had a gradient (unused, frozen in the user's step) has none in the checkpoint.
        held_state: dict[str, dict[str, torch.Tensor]] = {}
        live: dict[str, Any] = dict(get_optimizer_state_dict(self.module, self.optimizer))
        # A tied parameter's state is saved under the name its writer held it by: a pipeline's last stage
        # holds the GPT's head, a whole model the embedding it is tied to (StageNames.tied, parallel/pipeline.py).
        tied = self.stage.tied if self.stage else {}
        self.renamed = {}
        for fqn, values in split_tensors(live["state"])[0].items():
            for other in tied.get(fqn, []):
                absent = not any(key(fqn, name) in saved.tensors for name in values)
                if absent and any(key(other, name) in saved.tensors for name in values):
                    self.renamed[other] = fqn
                    fqn = other
            held = {name: tensor for name, tensor in values.items() if key(fqn, name) in saved.tensors}
            if held and len(held) < len(values):  # all of a parameter's state, or (never updated) none
                missing = sorted(set(values) - set(held))[0]
                raise CheckpointError(
                    f"checkpoint {saved.name} holds part of the optimizer state of '{fqn}' (no "
                    f"'{missing}'): damaged, or written for another optimizer; delete {saved.folder} to "
                    f"resume from an earlier checkpoint, or start a new run.dir"
                )
            if held:
                held_state[fqn] = held
        prefix = "optimizer/" if saved.flat else "optimizer.state."
        self.saved_any = any(name.startswith(prefix) for name in saved.tensors)  # none: saved before any update
        return {"state": held_state}

    def restore(self, saved: Saved, tensors: dict[str, Any]) -> None:
        groups = saved.trainer["optimizer"]["param_groups"]
        if len(groups) != len(self.optimizer.param_groups):
            raise CheckpointError(
                f"checkpoint {saved.name}'s optimizer has {len(groups)} parameter groups and this run's has "
                f"{len(self.optimizer.param_groups)} (optimizer.groups, optimizer.no_decay or whether weight decay "
                f"is 0 changed); resume with the groups it was written with, or start a new run.dir"
            )
        live_names = get_optimizer_state_dict(self.module, self.optimizer)["param_groups"]
        for saved_group, live, named in zip(groups, self.optimizer.param_groups, live_names, strict=True):
            # How the optimizer computes is this run's choice (fused on CUDA, not on the CPU), not the
            # checkpoint's: a fused flag loaded onto the other path breaks GradScaler's hand-off.
            saved_group.update({key: live[key] for key in _IMPLEMENTATION if key in live})
            # Its parameters are this process's: a pipeline stage holds other names than the writer's.
            saved_group["params"] = cast(dict[str, Any], named)["params"]
        entries = {fqn: dict(values) for fqn, values in saved.trainer["optimizer"]["state"].items()}
        for fqn, values in tensors["state"].items():
            entries.setdefault(self.renamed.get(fqn, fqn), {}).update(values)
        # Not strict: a parameter that never had a gradient has no optimizer state to set.
        state: Any = {"state": entries, "param_groups": groups}
        set_optimizer_state_dict(self.module, self.optimizer, state, options=StateDictOptions(strict=False))
        if not self.saved_any:
            self.optimizer.state.clear()  # saved before any update: undo DCP's zero-lr step here too


def _optimizer_problem(optimizer: Any) -> str | None:
    if not (
        isinstance(optimizer, dict)
        and isinstance(optimizer.get("state"), dict)
        and all(isinstance(entry, dict) for entry in optimizer["state"].values())
        and isinstance(optimizer.get("param_groups"), list)
        and all(isinstance(g, dict) for g in optimizer["param_groups"])
    ):
        return "its optimizer entry is malformed"
    for group in optimizer["param_groups"]:
        for key, value in group.items():
            # Rates are >= 0; another optimizer's settings may be below 0 or absent (Adafactor's beta2_decay
            # -0.8, its eps (None, 1e-3)).
            fits = is_rate if key in ("lr", "initial_lr", "weight_decay") else is_number
            if key != "params" and not (
                value is None
                or isinstance(value, bool)
                or fits(value)
                or (
                    isinstance(value, list)
                    and value
                    and all(fits(v) or (v is None and fits is is_number) for v in value)
                )
            ):
                return (
                    f"optimizer setting {key} is {value!r}, not a finite number >= 0, true/false or a list of numbers"
                )
    return None
