"""Hugging Face models named by their local folder: `model.name = "hf:PATH"` or `"hf-causal-lm:PATH"`.

The model is built from the folder's config.json, as `from_pretrained` would build it:

    hf:PATH            the class config.json names first in `architectures` (what saved the folder:
                       GPT2LMHeadModel, LlamaForCausalLM, ...), else `AutoModel` (the bare model)
    hf-causal-lm:PATH  `AutoModelForCausalLM`, whatever saved it

`model.options` override the config's attributes, as `from_pretrained(PATH, **kwargs)` does (e.g.
`{resid_pdrop = 0.0}`). The weights are the folder's: the Trainer reads them into the model at the
start of a new run, through the same loader as `model.init_from` (checkpoint/init_from.py), after the
strategy has spread the model, so that under FSDP each process reads only its shard (and builds only
its shard: the worker builds the parameters on the meta device, models/empty.py). Nothing is
downloaded, and no code from the folder is run (no `trust_remote_code`).

On token data (`data.name = tokens`) the model is called with the input ids and its logits are scored
against the next tokens, every position of the window, as dtrain's own GPT is (train/loss.py); a
dict batch with `labels` gives the model's own `.loss`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from torch import nn

from dtrain.errors import ConfigError


def check_folder(name: str, folder: str, weights: bool = False) -> dict[str, Any]:
    """The folder's config.json, or a one-line refusal (the launcher's, before any worker starts); with
    `weights`, the folder must hold them too (model.init_from names none other)."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        raise ConfigError(f"model.name = '{name}' needs transformers: pip install 'dtrain[hf]'")
    path = Path(folder) / "config.json"
    if not Path(folder).is_dir():
        raise ConfigError(f"model.name = '{name}': {folder} is not a folder; give a local Hugging Face model folder")
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"model.name = '{name}': {folder} holds no config.json; give a folder written by save_pretrained"
        ) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.name = '{name}': {path} cannot be read as JSON ({exc})") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ConfigError(
            f"model.name = '{name}': {path} names no model_type; give a folder written by save_pretrained"
        )
    if weights and not any((Path(folder) / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json")):
        raise ConfigError(
            f"model.name = '{name}': {folder} holds no model.safetensors (nor model.safetensors.index.json); "
            f"give a folder written by save_pretrained, or weights in model.init_from"
        )
    return config


def check_vocabulary(name: str, config: dict[str, Any], options: dict[str, Any], num_classes: int) -> None:
    """Refuse a model whose vocabulary (config.json's vocab_size, or model.options') is smaller than the
    data's: its embedding would be indexed past its end in the first step of every worker."""
    vocab = options.get("vocab_size", config.get("vocab_size"))
    if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab < num_classes:
        raise ConfigError(
            f"model.name = '{name}' has a vocabulary of {vocab} tokens and the data's has {num_classes} "
            f"(meta.json); train it on data made with its own tokenizer"
        )


def build(name: str, folder: str, options: dict[str, Any]) -> nn.Module:
    """The model `name` names, with its own initial weights (the Trainer loads the folder's)."""
    import torch
    import transformers

    check_folder(name, folder)
    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True, **options)
    except (ValueError, KeyError, OSError) as exc:
        raise ConfigError(f"model.name = '{name}': transformers cannot read {folder}/config.json ({exc})") from None
    # fp32 weights whatever dtype the folder was saved in: training.precision decides what computes in bf16.
    if name.startswith("hf-causal-lm:"):
        try:
            return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        except ValueError as exc:
            raise ConfigError(f"model.name = '{name}': {str(exc).splitlines()[0]}") from None
    architectures = getattr(config, "architectures", None) or []
    cls: Any = getattr(transformers, architectures[0], None) if architectures else transformers.AutoModel
    if cls is None:
        raise ConfigError(
            f"model.name = '{name}': config.json names architecture {architectures[0]}, which transformers "
            f"{transformers.__version__} does not have; use 'hf-causal-lm:{folder}'"
        )
    if cls is transformers.AutoModel:
        return cls.from_config(config, dtype=torch.float32)
    return cls._from_config(config, dtype=torch.float32)


def is_transformers_model(module: nn.Module) -> bool:
    # A model of transformers' has brought the library in already: nothing to import for one that has not.
    library = sys.modules.get("transformers")
    return library is not None and isinstance(module, library.PreTrainedModel)
