"""[model]: the model a run trains — built-in, a factory's, or a Hugging Face folder — and its options."""

from __future__ import annotations

import os
from dataclasses import dataclass

from dtrain.config.section import Section, check_builtin_or_factory, local_only
from dtrain.config.settings import coerce, setting
from dtrain.errors import ConfigError

# What the built-in models take and the built-in data sets give: token ids (integers) or features
# (floating-point values, any shape: a model's shape rules are its builder's). And the built-in models'
# options, with types and bounds checked as keys' are: a size below 1 or a fraction outside [0, 1]
# builds nothing that trains.
# Hugging Face model folders as model.name: the class config.json names, or AutoModelForCausalLM.
HF_PREFIXES = ("hf:", "hf-causal-lm:")
MODEL_TAKES = {"mlp": "features", "cnn": "features", "gpt": "tokens"}
DATA_GIVES = {"digits": "features", "mnist": "features", "synthetic": "features", "tokens": "tokens"}
_SIZE = {"min": 1, "max": 2**20}
MODEL_OPTIONS: dict[str, dict[str, tuple[type, dict]]] = {
    "mlp": {"hidden_size": (int, _SIZE)},
    "cnn": {"channels": (int, _SIZE)},
    "gpt": {
        "n_layer": (int, _SIZE),
        "n_head": (int, _SIZE),
        "n_embd": (int, _SIZE),
        "block_size": (int, _SIZE),
        "vocab_size": (int, {"min": 1, "max": 2**31}),
        "dropout": (float, {"min": 0, "max": 1}),
        "bias": (bool, {}),
    },
}
_KINDS = {
    "tokens": ("token ids", "integers: data.name=tokens"),
    "features": ("features", "floating-point values: digits, mnist, synthetic"),
}


def kind_problem(model: str, data: str, kind: str | None) -> str | None:
    """Why built-in `model` cannot train on data `data` whose samples are of `kind` (None: not known), or
    None: it would build, then fail in its first forward pass, in every worker."""
    takes = MODEL_TAKES.get(model)
    if takes is None or kind is None or takes == kind:
        return None
    fits = next(name for name, its in MODEL_TAKES.items() if its == kind)
    return (
        f"model.name = '{model}' takes {_KINDS[takes][0]} ({_KINDS[takes][1]}); data.name = '{data}' gives "
        f"{_KINDS[kind][0]}; use model.name={fits}"
    )


@dataclass(slots=True)
class ModelConfig(Section):
    name: str = setting(
        "mlp",
        "mlp (the guide's Linear-ReLU-Linear), cnn, gpt (a decoder-only transformer for "
        "data.name=tokens), a factory 'package.module:function', or a local Hugging Face model "
        "folder: 'hf:PATH' (the class its config.json names in architectures) or 'hf-causal-lm:PATH' "
        "(AutoModelForCausalLM), built from its config.json and started from its weights.",
    )
    init_from: str = setting(
        "",
        "Weights a new run starts from: a .safetensors file, a Hugging Face model folder, a dtrain "
        "run.dir (its model.safetensors, else its newest checkpoint) or a checkpoints/step-N folder. "
        "Names and shapes must match the model (a GPT-2 folder dtrain export wrote also starts the built-in "
        "gpt). A resumed run continues from its checkpoint instead. "
        "Under FSDP each process builds and reads only its shard.",
    )
    hidden_size: int = setting(1024, "Hidden width of the built-in mlp.", min=1, max=2**20)
    options: dict = setting(
        {},
        "Keyword arguments passed to a model factory (gpt: n_layer, n_head, n_embd, block_size, dropout, bias); "
        "for an hf: model, config.json values to override (as from_pretrained(PATH, **options)).",
    )
    blocks: list[str] = setting(
        [],
        "Module class names of the model's blocks: FSDP's units, and what "
        "activation checkpointing and compile=blocks work on (default: the model's "
        "_no_split_modules — its transformer blocks — else its ModuleList entries).",
    )

    def check(self) -> None:
        local_only("model.init_from", self.init_from, "the weights")
        self.init_from = os.path.expanduser(self.init_from)
        if self.hf_folder is not None:
            local_only("model.name", self.hf_folder, "the Hugging Face model folder", self.name)
            if not self.hf_folder:
                raise ConfigError(f"model.name = '{self.name}' names no folder; give 'hf:PATH' or 'hf-causal-lm:PATH'")
            return
        check_builtin_or_factory("model.name", self.name, tuple(MODEL_TAKES))
        for key, (type_, bounds) in MODEL_OPTIONS.get(self.name, {}).items():
            if key in self.options:  # the others are the builder's to refuse (the launcher builds it first)
                self.options[key] = coerce(f"model.options.{key}", self.options[key], type_, bounds, None)

    @property
    def hf_folder(self) -> str | None:
        """The folder of a Hugging Face model (`hf:PATH`, `hf-causal-lm:PATH`), else None."""
        prefix = next((p for p in HF_PREFIXES if self.name.startswith(p)), None)
        return None if prefix is None else os.path.expanduser(self.name[len(prefix) :])

    @property
    def weights(self) -> tuple[str, str] | None:
        """The weights a new run starts from, as (the key that names them, the path): model.init_from,
        else a Hugging Face model's own folder; None for the model's own initialisation."""
        if self.init_from:
            return "model.init_from", self.init_from
        return ("model.name", self.hf_folder) if self.hf_folder else None
