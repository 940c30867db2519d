"""A one-process Trainer run that diverges at its first step, logging to MLflow's local store, with a
SIGTERM landing while the tracker ends its run — as torchrun's agent stops a failed job's other ranks.
Exits 2 (the diverged run's status) when the SIGTERM did not cut the run's ending short."""

import os
import signal
import sys

import tiny

import dtrain
from dtrain.observe import trackers

end_run = trackers.MLflowTracker.close


def close_under_sigterm(self, *args):
    os.kill(os.getpid(), signal.SIGTERM)  # delivered at the next bytecode: inside the tracker's ending
    end_run(self, *args)


trackers.MLflowTracker.close = close_under_sigterm
config = tiny.job_config(
    sys.argv[1],
    {**tiny.SMALL, "optimizer": {"name": "sgd", "lr": 1e30}, "monitor": {"trackers": ["mlflow"]}},
    epochs=2,
    log_every=1,
)
try:
    dtrain.Trainer(config, model=tiny.small_model(), train_data=tiny.small_data(96, 0)).fit()
except dtrain.DtrainError as exc:
    print(exc, file=sys.stderr)
    sys.exit(2)
