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


_X = torch.randn(8, 3)


# Data factories returning the wrong kind of thing.
def returns_a_string(config):
    return "not data"


def returns_a_number(config):
    return 3


def returns_an_empty_set(config):
    return TensorDataset(_X[:0], _X[:0, 0].long())


def returns_a_dict_without_train(config):
    return {"training": TensorDataset(_X, _X[:, 0].long())}


def returns_a_bad_eval_set(config):
    return TensorDataset(_X, _X[:, 0].long()), 42


def returns_unreadable_samples(config):
    return _Unreadable()


class _Unreadable(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        raise KeyError("no such sample")


def no_parameters(input_shape, num_classes):
    return nn.ReLU()
