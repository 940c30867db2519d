"""A job described in TOML: typed sections, `key=value` overrides, validation with one-line answers.

Every setting is declared once, in its section's module (run.py, distributed.py, parallel.py, ddp.py,
model.py, data.py, optimizer.py, scheduler.py, training.py, monitor.py, checkpoint.py; section.py: what
they share), with its type, default, bounds and a sentence of help; loading, overriding, validating,
writing `config.toml` and the README's reference table all come from that one declaration (settings.py:
the declaration and coercion; job.py: the whole config, and the old names of keys that moved). Nothing
here imports torch but to check a name from torch (an optimizer beyond sgd and adamw, a
torch.optim.lr_scheduler class): the launcher reads configs before any worker starts.
"""

from dtrain.config.checkpoint import CheckpointConfig
from dtrain.config.data import DataConfig
from dtrain.config.ddp import DDPConfig
from dtrain.config.distributed import DistributedConfig
from dtrain.config.job import (
    RENAMED,
    SECTIONS,
    Config,
    all_keys,
    check_model_fits_data,
    idle_settings,
    load_config,
    read_config,
    reference_rows,
    validate,
    with_global_batch,
)
from dtrain.config.model import ModelConfig
from dtrain.config.monitor import MonitorConfig, ProfileConfig, profile_range
from dtrain.config.optimizer import OptimizerConfig
from dtrain.config.parallel import ParallelConfig
from dtrain.config.run import RunConfig
from dtrain.config.scheduler import SchedulerConfig
from dtrain.config.settings import setting, tomllib, where
from dtrain.config.training import TrainingConfig

__all__ = [
    "RENAMED",
    "SECTIONS",
    "CheckpointConfig",
    "Config",
    "DDPConfig",
    "DataConfig",
    "DistributedConfig",
    "ModelConfig",
    "MonitorConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "ProfileConfig",
    "RunConfig",
    "SchedulerConfig",
    "TrainingConfig",
    "all_keys",
    "check_model_fits_data",
    "idle_settings",
    "load_config",
    "profile_range",
    "read_config",
    "reference_rows",
    "setting",
    "tomllib",
    "validate",
    "where",
    "with_global_batch",
]
