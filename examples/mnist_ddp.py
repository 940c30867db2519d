"""The guide's MNIST example, rewritten with dtrain's API.

The guide's script sets up the process group, wraps the model in DDP, builds a DistributedSampler
and calls set_epoch by hand. Here the Trainer does all of that (and exact eval, TensorBoard,
metrics.jsonl and safetensors weights); the script only says what to train on what.

    dtrain launch --nproc 2 examples/mnist_ddp.py --data data/mnist
    torchrun --nproc-per-node 2 examples/mnist_ddp.py --data data/mnist     # the same, by hand
"""

import argparse

from torch import nn
from torch.utils.data import TensorDataset

import dtrain
from dtrain.data import mnist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="data/mnist", help="folder with the four MNIST IDX files")
    parser.add_argument("--download", action="store_true", help="fetch MNIST into --data if missing")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--run-dir", default="runs/mnist_ddp")
    args = parser.parse_args()

    if args.download and mnist.find_files(args.data) is None:
        mnist.download(args.data)  # atomic per file: safe when every process does it
    # float in [0, 1], like ToTensor; missing files are named in one line, with this script's own flag
    (train_x, train_y), (test_x, test_y) = mnist.load(args.data, fetch="pass --download", key="--data")

    # The guide's model, unchanged.
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 10))

    # The guide's choices: batch 64 per process, SGD at lr 0.01, 10 epochs.
    config = dtrain.Config.from_dict(
        {
            "run": {"dir": args.run_dir},
            "data": {"batch_size": 64},
            "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.0},
            "training": {"epochs": args.epochs, "log_every": 50},
        }
    )
    trainer = dtrain.Trainer(
        config, model=model, train_data=TensorDataset(train_x, train_y), eval_data=TensorDataset(test_x, test_y)
    )
    trainer.fit()


if __name__ == "__main__":
    main()
