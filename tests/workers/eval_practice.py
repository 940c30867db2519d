"""Run under torchrun with 2 or 3 processes: evaluation as practitioners run it.

    torchrun --standalone --nproc-per-node N eval_practice.py OUT_DIR

At 2 ranks: a run evaluating every 2 steps over a capped eval split; at every world size: a whole-split
F1 next to scikit-learn's on rank 0's own predictions. Rank 0 writes OUT_DIR/results.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from scenarios import config, data, fresh_model
from sklearn.metrics import f1_score

import dtrain

HELD_OUT = 101  # divided by neither 2 nor 3 ranks


def fingerprint(output, batch):
    """Which samples were evaluated, whatever the weights: the mean of their first feature."""
    return {"x0": batch[0][:, 0].mean()}


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    world, held_out = dist.get_world_size(), data(HELD_OUT, 1)
    results: dict = {"world": world}

    if world == 2:  # batch 16 × 2 ranks over 96 samples: 3 steps an epoch, 6 in all
        capped = config(
            out / "steps", {"data": {"eval_batch_size": 10}}, eval_every_steps=2, eval_batches=3, log_every=4
        )
        dtrain.Trainer(
            capped, model=fresh_model(), train_data=data(96, 0), eval_data=held_out, eval_metrics=fingerprint
        ).fit()

        # keep_best through pruning (keep=1) and a resume: the worst eval loss, so that the best is not the newest.
        best = {"checkpoint": {"every_steps": 1, "keep": 1, "keep_best": "eval_loss:max"}}
        for stop_at in (4, 0):  # a run stopped at step 4 (mid-epoch), then resumed to its end
            job = config(out / "best", best, eval_every_steps=1, stop_at_step=stop_at)
            dtrain.Trainer(job, model=fresh_model(), train_data=data(96, 0), eval_data=held_out).fit()
            if dist.get_rank() == 0:
                results[f"kept_after_{stop_at}"] = sorted(p.name for p in (out / "best" / "checkpoints").iterdir())
        epochs = config(out / "epochs", {"checkpoint": {"every_epochs": 1, "keep": 5}})
        dtrain.Trainer(epochs, model=fresh_model(), train_data=data(96, 0), eval_data=held_out).fit()

    def f1(predictions, targets):
        return {
            "f1": f1_score(targets.numpy(), predictions.argmax(1).numpy(), average="macro"),
            "seen": len(targets),
            "in_order": float(torch.equal(targets, held_out.tensors[1])),  # each sample once, in the split's order
        }

    scored = dtrain.Trainer(
        config(out / "f1", {"data": {"eval_batch_size": 8}}, max_steps=3),
        model=fresh_model(),
        train_data=data(96, 0),
        eval_data=held_out,
        eval_metrics=dtrain.whole_split(f1),
    )
    scored.fit()
    results["whole_split"] = scored.evaluate()
    with torch.no_grad():
        mine = scored.module(held_out.tensors[0]).argmax(1)
    results["sklearn_f1"] = f1_score(held_out.tensors[1].numpy(), mine.numpy(), average="macro")

    if dist.get_rank() == 0:
        (out / "results.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
