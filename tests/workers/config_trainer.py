"""A user's script that trains a config as `dtrain run` would, through the Python API — so that one job
runs the same under `dtrain run` and `dtrain launch`: `config_trainer.py CONFIG.toml [section.key=value ...]`."""

import sys

import torch

import dtrain
from dtrain import data, models

config = dtrain.load_config(sys.argv[1], sys.argv[2:])
splits = data.build(config)
torch.manual_seed(config.run.seed)
model = models.build(config.model, splits.input_shape, splits.num_classes)
dtrain.Trainer(config, model=model, train_data=splits.train, eval_data=splits.eval).fit()
