"""Run under torchrun with 2 processes: stop at step k, resume, and compare with an unbroken run.

    torchrun --standalone --nproc-per-node 2 resume_scenarios.py OUT_DIR

Each variant trains three times in the same group: uninterrupted, stopped at `stop` (with a
checkpoint, as `training.stop_at_step` does), and resumed from that checkpoint by a fresh Trainer
with a model initialised differently (so a Trainer that silently started afresh could not end equal).
Rank 0 writes OUT_DIR/results.json: per variant, whether the final weights are bitwise equal, the
step the resumed Trainer started from, and how many training forward passes each part made.
"""

import json
import sys
from pathlib import Path

import tiny
import torch
import torch.distributed as dist
from faults import DyingMLP
from safetensors.torch import load_file

import dtrain

N_TRAIN, BATCH = 150, 8  # 75 samples per rank: 10 micro-batches an epoch (the last one partial)

VARIANTS = {
    # name: (config overrides, stop step)
    "mid_epoch": ({}, 7),
    "epoch_boundary": ({}, 10),
    "accumulation": ({"training": {"grad_accum_steps": 3}}, 5),  # 4 steps an epoch (3+3+3+1)
    "bf16": ({"training": {"precision": "bf16"}}, 13),
    "adamw": ({"optimizer": {"name": "adamw", "lr": 0.003}}, 6),
}


JOB = {
    "run": {"seed": 3},
    "data": {"batch_size": BATCH},
    "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    "scheduler": {"name": "cosine", "warmup_steps": 3},
    "training": {"epochs": 3, "log_every": 2, "max_grad_norm": 5.0},
}


def config(run_dir: Path, overrides: dict, **training) -> dtrain.Config:
    return tiny.job_config(run_dir, JOB, overrides, **training)


def model(seed: int = 11) -> torch.nn.Module:
    return tiny.seeded(lambda: DyingMLP((12,), 3, hidden_size=32, dropout=0.2), seed)  # dropout: RNG matters


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    data = tiny.points(N_TRAIN, 12, 0, lambda x: x[:, :3].argmax(1))
    results = {}
    for name, (overrides, stop) in VARIANTS.items():
        unbroken = dtrain.Trainer(config(out / name / "unbroken", overrides), model=model(), train_data=data)
        unbroken.fit()
        broken = out / name / "broken"
        first = dtrain.Trainer(config(broken, overrides, stop_at_step=stop), model=model(), train_data=data)
        first.fit()
        # Trainer.fit() resumes by itself (checkpoint.resume = auto), into a differently seeded model.
        second = dtrain.Trainer(config(broken, overrides), model=model(seed=99), train_data=data)
        second.setup()
        resumed_at = second.step
        second.fit()
        # The same command once more: the run is complete (its end was checkpointed because it had a
        # checkpoint), so nothing trains again.
        third = dtrain.Trainer(config(broken, overrides), model=model(seed=7), train_data=data)
        third.fit()
        w1 = load_file(str(out / name / "unbroken" / "model.safetensors"))
        w2 = load_file(str(broken / "model.safetensors"))
        results[name] = {
            "stopped_at": first.step,
            "resumed_at": resumed_at,
            "total_steps": unbroken.step,
            # Training forward passes (micro-batches) each part made: the resumed one only the rest.
            "forwards": [unbroken.module.forwards, first.module.forwards, second.module.forwards],
            "equal": all(torch.equal(w1[k], w2[k]) for k in w1),
            "checkpoints": sorted(p.name for p in (broken / "checkpoints").iterdir()),
            "rerun": [third.step, third.module.forwards],
        }
    if dist.get_rank() == 0:
        (out / "results.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
