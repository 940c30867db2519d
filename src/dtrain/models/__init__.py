"""Built-in models (the guide's MLP, a small CNN, a GPT) and user model factories."""

from __future__ import annotations

import math

import torch
from torch import nn

from dtrain import factory
from dtrain.config import Config, ModelConfig
from dtrain.config.model import kind_problem
from dtrain.errors import ConfigError


def mlp(input_shape: tuple[int, ...], num_classes: int, hidden_size: int = 1024) -> nn.Module:
    """The guide's model: Linear(in, 1024) → ReLU → Linear(1024, 10), on flattened inputs."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(input_shape), hidden_size),
        nn.ReLU(),
        nn.Linear(hidden_size, num_classes),
    )


def cnn(input_shape: tuple[int, ...], num_classes: int, channels: int = 32) -> nn.Module:
    """Two conv blocks and a linear head, for image-shaped inputs (C×H×W)."""
    if len(input_shape) != 3:
        raise ConfigError(
            f"model.name = 'cnn' needs image inputs shaped C×H×W; the data gives "
            f"{list(input_shape)}; use model.name=mlp"
        )
    c = input_shape[0]
    return nn.Sequential(
        nn.Conv2d(c, channels, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(channels, 2 * channels, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * channels, num_classes),
    )


def gpt(
    input_shape: tuple[int, ...],
    num_classes: int,
    n_layer: int = 4,
    n_head: int = 4,
    n_embd: int = 256,
    block_size: int | None = None,
    dropout: float = 0.0,
    bias: bool = False,
    vocab_size: int | None = None,
) -> nn.Module:
    """The built-in GPT (gpt.py) for token data: its block_size defaults to data.block_size and its
    vocabulary to the data's (meta.json)."""
    from dtrain.models.gpt import GPT

    if len(input_shape) != 1:
        raise ConfigError(
            f"model.name = 'gpt' needs token sequences (data.name=tokens); the data gives samples "
            f"shaped {list(input_shape)}"
        )
    window = input_shape[0]
    block_size = window if block_size is None else block_size
    if block_size < window:
        raise ConfigError(
            f"model.options.block_size = {block_size} is shorter than data.block_size = {window}; "
            f"raise it or lower data.block_size"
        )
    vocab_size = num_classes if vocab_size is None else vocab_size
    if vocab_size < num_classes:
        raise ConfigError(
            f"model.options.vocab_size = {vocab_size} is smaller than the data's vocabulary "
            f"({num_classes} tokens, meta.json); drop it to use the data's"
        )
    if n_embd % n_head:
        raise ConfigError(f"model.options.n_embd = {n_embd} must be a multiple of n_head = {n_head}")
    return GPT(vocab_size, block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd, dropout=dropout, bias=bias)


BUILT_IN = {"mlp": mlp, "cnn": cnn, "gpt": gpt}


def check(config: ModelConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module | None:
    """Refuse, before any worker starts, a built-in model that its options cannot build for data of this
    shape: it is built on the meta device (no memory, no time), so that its builder's own rules (the cnn's
    C×H×W, the gpt's n_embd a multiple of n_head, its block_size and vocabulary) speak now, once. Returns
    that model on the meta device (for the strategy's checks, and the weights it starts from: launch
    preflight), or None for a model it does not build."""
    if config.hf_folder is not None:
        from dtrain.models import hf

        hf.check_vocabulary(config.name, hf.check_folder(config.name, config.hf_folder), config.options, num_classes)
    if config.name in BUILT_IN:
        with torch.device("meta"):
            model = build(config, input_shape, num_classes)
        return model  # on the meta device: the launcher checks how it splits (pipeline parallel)
    return None


def check_folder(config: ModelConfig) -> None:
    """Refuse, before any worker starts, a Hugging Face model folder that is none, in one line."""
    if config.hf_folder is not None:
        from dtrain.models import hf

        hf.check_folder(config.name, config.hf_folder, weights=not config.init_from)


def check_kind(config: Config, kind: str | None) -> None:
    """Refuse a built-in model for data whose samples are not of the kind it takes. For a built-in data set
    the config's checks know it; a factory's tells only once built (data.kind_of)."""
    problem = kind_problem(config.model.name, config.data.name, kind)
    if problem:
        raise ConfigError(problem)


def build(config: ModelConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The model `config` names, sized for the data."""
    offered = {"input_shape": input_shape, "num_classes": num_classes}
    if config.hf_folder is not None:
        from dtrain.models import hf

        return hf.build(config.name, config.hf_folder, config.options)
    if config.name in BUILT_IN:
        config.check()  # its options' types and bounds, for a config built in code too
        if config.name == "mlp":
            offered["hidden_size"] = config.hidden_size
        return factory.call(BUILT_IN[config.name], offered, config.options)
    fn = factory.resolve("model.name", config.name)
    model = factory.call(fn, offered, config.options)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.name = '{config.name}' returned {type(model).__name__}, not a torch.nn.Module")
    return model
