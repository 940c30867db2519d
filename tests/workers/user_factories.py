"""Factories a user would reference from a config as 'user_factories:...'."""

import torch
from torch import nn
from torch.utils.data import TensorDataset


def tiny_data(config):
    g = torch.Generator().manual_seed(config.run.seed)
    x = torch.randn(96, 6, generator=g)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    return TensorDataset(x[:64], y[:64]), TensorDataset(x[64:], y[64:])


def wide_model(input_shape, num_classes, width=16):
    return nn.Sequential(nn.Linear(input_shape[0], width), nn.Tanh(), nn.Linear(width, num_classes))


def not_a_model(input_shape, num_classes):
    return "nope"


def explode(config):
    raise RuntimeError("data factory exploded")
