"""LoRA fine-tuning through Hugging Face peft: `training.lora = {r, alpha, dropout, target_modules}`.

peft's adapters are injected into the model in place (`peft.inject_adapter_in_model`), so the model stays
the user's own class under its own names — FSDP's blocks, the loss, model.json see what they saw — and
each adapted layer gains `.base_layer` (the frozen original) and `.lora_A.default` / `.lora_B.default`
(what trains). The base model's weights are read before the adapters go in (`prepare`): on a resume too,
since a checkpoint holds only the adapters and names the base it was trained on (`base_reference`).

The defaults, in one place (`DEFAULTS`, `default_targets`):

    alpha            2 × r (peft's own default is 8 whatever r; 2 r is the common recipe)
    dropout          0.0 (a resume is exact either way: dropout's RNG is checkpointed)
    target_modules   built-in gpt: c_attn, c_proj, c_fc (every attention and MLP projection);
                     a transformers model: peft's list for its model_type (gpt2: c_attn; llama: q_proj,
                     v_proj), else every linear layer but the output head ("all-linear");
                     any other model: none — name them
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from torch import nn

from dtrain.config import Config
from dtrain.errors import ConfigError

ADAPTER = "default"  # peft's adapter name inside the model's names (`lora_A.default`)
MARK = "dtrain_lora"  # the attribute a LoRA model carries: its `Lora` (checkpoint.parts asks for it)
GPT_TARGETS = ["c_attn", "c_proj", "c_fc"]


@dataclass
class Lora:
    """What a LoRA model was made with: peft's LoraConfig settings and the base it adapts."""

    settings: dict[str, Any]  # r, lora_alpha, lora_dropout, target_modules (resolved)
    base: str  # where the base weights came from (a path, a Hugging Face folder) or how it was given
    weights: tuple[str, str] | None = None  # (the key, the path) of the base weights, where a file holds them

    def described(self) -> dict[str, Any]:
        weights = {"weights": [self.weights[0], os.path.abspath(self.weights[1])]} if self.weights else {}
        return {"settings": self.settings, "base": self.base, **weights}


def of(module: nn.Module) -> Lora | None:
    """The module's LoRA, or None for a model trained whole."""
    found = getattr(module, MARK, None)
    return found if isinstance(found, Lora) else None


def base_reference(config: Config, module: nn.Module | None = None) -> str:
    """The base the adapters go on, as a checkpoint and model.json name it: model.init_from's path, an hf:
    folder, else (a model given in code) a transformers model's own name_or_path, else its own initial
    weights (drawn with run.seed; a script giving its model in code rebuilds it on resume)."""
    if config.model.weights is not None:
        key, path = config.model.weights
        return f"{key} = {os.path.abspath(path)}"
    name = getattr(getattr(module, "config", None), "_name_or_path", "") if module is not None else ""
    built = f"{type(module).__name__}, " if module is not None else ""
    return f"given in code: {name}" if name else f"its own initial weights ({built}run.seed {config.run.seed})"


def default_targets(module: nn.Module) -> list[str] | str:
    """target_modules when training.lora does not name them (see the module's docstring)."""
    from dtrain.models.gpt import GPT
    from dtrain.models.hf import is_transformers_model

    if isinstance(module, GPT):
        return list(GPT_TARGETS)
    if is_transformers_model(module):
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as BY_TYPE

        model_type = getattr(getattr(module, "config", None), "model_type", None)
        return list(BY_TYPE[model_type]) if model_type in BY_TYPE else "all-linear"
    raise ConfigError(
        f"training.lora: dtrain has no default target_modules for a {type(module).__name__}; name the layers "
        f'to adapt, e.g. training.lora={{r = 8, target_modules = ["0", "2"]}} (names of its nn.Linear modules)'
    )


def settings(lora: dict[str, Any], module: nn.Module) -> dict[str, Any]:
    """training.lora as peft's LoraConfig arguments, defaults filled in."""
    r = int(lora["r"])
    targets = lora.get("target_modules") or default_targets(module)
    return {
        "r": r,
        "lora_alpha": float(lora.get("alpha", 2 * r)),
        "lora_dropout": float(lora.get("dropout", 0.0)),
        "target_modules": targets,
    }


def peft_config(settings: dict[str, Any], base: str = "") -> Any:
    from peft import LoraConfig

    return LoraConfig(**settings, bias="none", base_model_name_or_path=base or None)


def inject(module: nn.Module, lora: Lora) -> nn.Module:
    """Put the adapters into `module` in place (base parameters frozen, adapters trainable) and mark it;
    a target that matches no layer, or a layer peft cannot adapt, is one line."""
    try:
        from peft import inject_adapter_in_model
    except ImportError:
        raise ConfigError("training.lora needs Hugging Face peft: pip install 'dtrain[lora]'") from None
    try:
        inject_adapter_in_model(peft_config(lora.settings), module, adapter_name=ADAPTER)
    except (ValueError, TypeError, NotImplementedError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"training.lora.target_modules = {lora.settings['target_modules']!r} cannot adapt this "
            f"{type(module).__name__} ({first}); name its nn.Linear layers (e.g. {_linear_names(module)})"
        ) from None
    for name, param in module.named_parameters():  # peft's rule, said plainly: only the adapters train
        param.requires_grad_(".lora_" in f".{name}")
    setattr(module, MARK, lora)
    return module


def wanted(config: Config, module: nn.Module) -> bool:
    """Whether `module` is to get adapters: training.lora, and none injected yet."""
    return bool(config.training.lora) and of(module) is None


def prepare(config: Config, module: nn.Module) -> nn.Module:
    """A LoRA run's model, its base weights already read (checkpoint/init_from.py `lora_base`): the
    adapters injected. Without training.lora, the module as it is."""
    if not wanted(config, module):
        return module
    lora = Lora(settings(config.training.lora, module), base_reference(config, module), config.model.weights)
    return inject(module, lora)


def saved(module: nn.Module, state: dict[str, Any] | None) -> dict[str, Any] | None:
    """What a run keeps of `module`'s full state dict (its final weights): a LoRA model's adapters only."""
    return adapter_state(state) if state is not None and of(module) is not None else state


def adapter_state(state: dict[str, Any]) -> dict[str, Any]:
    """The adapters' tensors of a LoRA model's state dict (what trains: what a LoRA run saves)."""
    return {name: value for name, value in state.items() if ".lora_" in f".{name}"}


def as_peft_names(state: dict[str, Any]) -> dict[str, Any]:
    """Adapter tensors under the names PeftModel.save_pretrained writes (`base_model.model.` before,
    the adapter's name taken out), which `PeftModel.from_pretrained` reads."""
    return {f"base_model.model.{name.replace(f'.{ADAPTER}.', '.')}": value for name, value in state.items()}


def merge(module: nn.Module) -> nn.Module:
    """`module` with every adapter merged into its base layer and the LoRA layers taken out: the plain
    model under its original names (peft's merge_and_unload, for a model with adapters injected)."""
    from peft.tuners.lora import LoraLayer

    for name, layer in list(module.named_modules()):
        if isinstance(layer, LoraLayer):
            layer.merge(adapter_names=[ADAPTER])
            parent_name, _, child = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            setattr(parent, child, layer.get_base_layer())
    if hasattr(module, MARK):
        delattr(module, MARK)
    if hasattr(module, "peft_config"):
        delattr(module, "peft_config")
    return module


def _linear_names(module: nn.Module) -> str:
    names = [n.rpartition(".")[2] for n, m in module.named_modules() if isinstance(m, nn.Linear)]
    unique = list(dict.fromkeys(names))
    return ", ".join(unique[:4]) or "none: it has no nn.Linear"
