"""What a run.dir says of the model it trained, in `model.json`: enough to export its weights later in
another library's layout (`dtrain export`) with no live model — a Hugging Face model's config and class,
the built-in GPT's options — or, for any other model, its class, so that the refusal can name it.

    {"written_by": "dtrain", "kind": "gpt", "options": {"vocab_size": ..., "block_size": ..., ...}}
    {"written_by": "dtrain", "kind": "transformers", "architecture": "GPT2LMHeadModel", "config": {...}}
    {"written_by": "dtrain", "kind": "other", "class": "Sequential"}

A LoRA run's also holds "lora": {"settings": peft's LoraConfig arguments, "base": where its base came from}.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from dtrain.errors import DtrainError
from dtrain.files import atomic_write_text
from dtrain.models import hf

MODEL_FILE = "model.json"
GPT, TRANSFORMERS, OTHER = "gpt", "transformers", "other"


def describe(module: nn.Module) -> dict[str, Any]:
    """`module` as model.json says it; a LoRA model's also says its adapters' settings and base ("lora")."""
    from dtrain.models import lora

    adapted = lora.of(module)
    said = _describe(module)
    return {**said, "lora": adapted.described()} if adapted is not None else said


def _describe(module: nn.Module) -> dict[str, Any]:
    from dtrain.models.gpt import GPT as BuiltInGPT

    if isinstance(module, BuiltInGPT):
        options = {
            "vocab_size": module.vocab_size,
            "block_size": module.block_size,
            "n_layer": module.n_layer,
            "n_head": module.n_head,
            "n_embd": module.n_embd,
            "dropout": float(module.dropout),
            "bias": bool(module.bias),
        }
        return {"written_by": "dtrain", "kind": GPT, "options": options}
    if hf.is_transformers_model(module):
        # FSDP2 makes the model an instance of a class of its own (FSDPGPT2LMHeadModel): the library's is named.
        cls = next(c for c in type(module).__mro__ if c.__module__.startswith("transformers."))
        try:
            config = json.loads(module.config.to_json_string(use_diff=False))  # type: ignore[union-attr,operator]
        except (TypeError, ValueError) as exc:  # a config of the user's own that JSON cannot hold: train anyway
            return {"written_by": "dtrain", "kind": OTHER, "class": f"{cls.__name__} whose config is not JSON ({exc})"}
        return {"written_by": "dtrain", "kind": TRANSFORMERS, "architecture": cls.__name__, "config": config}
    return {"written_by": "dtrain", "kind": OTHER, "class": type(module).__name__}


def write(run_dir: Path, module: nn.Module) -> None:
    """model.json for the model this run trains (rank 0, at the start of every run and resume)."""
    atomic_write_text(run_dir / MODEL_FILE, json.dumps(describe(module), indent=1) + "\n")


def read(run_dir: Path) -> dict[str, Any] | None:
    """The run's model.json, or None when it has none (runs before dtrain wrote one)."""
    path = run_dir / MODEL_FILE
    if not path.is_file():
        return None
    try:
        described = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise DtrainError(f"{path} is not readable JSON ({exc}); it is not what dtrain writes") from None
    if not isinstance(described, dict) or described.get("kind") not in (GPT, TRANSFORMERS, OTHER):
        raise DtrainError(f"{path} is not what dtrain writes (no kind of model it knows)")
    return described


def not_exportable(described: dict[str, Any]) -> str | None:
    """Why a model so described has no Hugging Face layout, or None when it has one."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        return "a Hugging Face folder is written with transformers, which is not installed: pip install 'dtrain[hf]'"
    if described["kind"] == OTHER:
        return (
            f"the run trained a {described.get('class', 'model')}: export needs the built-in gpt "
            f"(model.name = gpt) or a Hugging Face transformers model"
        )
    return None
