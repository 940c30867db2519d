"""dtrain: data-parallel PyTorch training across processes and machines, done for you.

import dtrain
config = dtrain.load_config("examples/digits_mlp.toml", ["training.epochs=3"])
dtrain.Trainer(config, model=net, train_data=train_set, eval_data=test_set).fit()
"""

__version__ = "0.1.0"

import os as _os

if _os.environ.get("DTRAIN_LAUNCHED") and "RANK" in _os.environ:
    # A worker of dtrain's launcher, starting: SIGTERM or Ctrl-C from here until its Trainer takes over ends it
    # with dtrain's one line (75, 130), not a KeyboardInterrupt traceback from inside an import. First thing,
    # before anything heavy is imported (`python -m dtrain...` imports this package before its module).
    from dtrain import early_stop as _early_stop

    _early_stop.install(interrupt=True)

from dtrain.config import Config, load_config
from dtrain.errors import ConfigError, DataError, DtrainError

__all__ = [
    "Config",
    "ConfigError",
    "DataError",
    "DtrainError",
    "Trainer",
    "__version__",
    "load_config",
    "load_weights",
    "pad_to_longest",
    "whole_split",
]


def __getattr__(name):
    # Imported on first use: the command line answers a config mistake without loading torch.
    if name == "Trainer":
        from dtrain.train.trainer import Trainer

        return Trainer
    if name == "load_weights":  # a run's model.safetensors, tied tensors under each of their names
        from dtrain.export.weights import load_weights

        return load_weights
    if name == "whole_split":  # eval_metrics=dtrain.whole_split(fn): fn(predictions, targets) of the whole split
        from dtrain.train.whole_split import whole_split

        return whole_split
    if name == "pad_to_longest":  # collate_fn=dtrain.pad_to_longest(tokenizer=tok): rows padded per batch
        from dtrain.data.padding import pad_to_longest

        return pad_to_longest
    raise AttributeError(f"module 'dtrain' has no attribute {name!r}")
