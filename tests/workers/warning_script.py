"""A user's script under `dtrain launch`: it imports libraries that warn once per process (a
transformers warning, a Python and a logging warning of another library), then trains a few steps."""

import sys

import noisy_library  # noqa: F401 — its warnings are the point
import tiny
from transformers.utils import logging as hf_logging

import dtrain

hf_logging.get_logger("transformers").warning("transformers: a warning said once per process")
config = tiny.small_config(sys.argv[1], training={"epochs": 1, "max_steps": 2, "log_every": 1})
dtrain.Trainer(config, model=tiny.small_model(), train_data=tiny.small_data(64)).fit()
