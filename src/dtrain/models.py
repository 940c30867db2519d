"""Built-in models (the guide's MLP, a small CNN) and user model factories."""

from __future__ import annotations

import math

from torch import nn

from . import factory
from .config import ModelConfig
from .errors import ConfigError


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
        raise ConfigError(f"model.name = 'cnn' needs image inputs shaped C×H×W; the data gives "
                          f"{list(input_shape)}; use model.name=mlp")
    c = input_shape[0]
    return nn.Sequential(
        nn.Conv2d(c, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(2 * channels, num_classes),
    )


def build(config: ModelConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The model `config` names, sized for the data."""
    offered = {"input_shape": input_shape, "num_classes": num_classes}
    if config.name == "mlp":
        return factory.call(mlp, {**offered, "hidden_size": config.hidden_size}, config.options)
    if config.name == "cnn":
        return factory.call(cnn, offered, config.options)
    fn = factory.resolve("model.name", config.name)
    model = factory.call(fn, offered, config.options)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.name = '{config.name}' returned {type(model).__name__}, not a "
                          f"torch.nn.Module")
    return model
