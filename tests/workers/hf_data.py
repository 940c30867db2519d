"""Data sets as their users have them, trained by `dtrain launch` on a tiny Hugging Face GPT-2:

    dtrain launch --nproc 2 tests/workers/hf_data.py OUT KIND [section.key=value ...]

KIND is the training set: `dataset` (a `datasets.Dataset` from a local dict, its rows Python lists, batched
by the user's `collate_fn`), `dataset-torch` (the same after `set_format("torch")`, default collation),
`streaming` (a `datasets.IterableDataset` from a generator of 4 shards, with a streamed eval set of
N_EVAL rows in one shard), `own-take` (a map-style set with a `take(n)`
method of its own, as many libraries have), `torch-iterable` (a `torch.utils.data.IterableDataset` of
numbered samples), `stateful-loader` (a torchdata StatefulDataLoader, batch size 4, over a torch iterable
of the same rows that says its position) or `loader` (a DataLoader over the `dataset` rows, batch size 3,
not shuffled). Nothing is downloaded. Every rank writes OUT/seen-rank<R>.json, the sample ids of each
micro-batch it trained on (in order), and OUT/evaluated-rank<R>.json, those of each evaluation; rank 0
writes OUT/facts.json. DTRAIN_TEST_STEP_SLEEP_S slows each step down
(to be stopped mid-run).
"""

import json
import os
import sys
import time
from pathlib import Path

import datasets
import torch
from hf_gpt2 import BLOCK, VOCAB, tiny_gpt2
from torch.utils.data import DataLoader, IterableDataset

import dtrain

N = 48  # samples: 24 a rank, 3 steps a pass at batch size 4 and 2 accumulation steps
N_EVAL = 21  # the streamed eval set: 11 and 10 rows on 2 ranks


def rows(n: int = N) -> dict[str, list]:
    """Token rows with a learnable pattern (each row counts up from a random start), and their ids."""
    starts = torch.randint(0, VOCAB, (n, 1), generator=torch.Generator().manual_seed(1))
    ids = ((starts + torch.arange(BLOCK)) % VOCAB).tolist()
    return {"id": list(range(n)), "input_ids": ids, "labels": ids}


def stack_rows(samples: list[dict]) -> dict[str, torch.Tensor]:
    """The user's collate_fn for rows of Python lists."""
    return {key: torch.tensor([s[key] for s in samples]) for key in ("id", "input_ids", "labels")}


class OwnTake(torch.utils.data.Dataset):
    """A map-style set whose `take(n)` means "the first n samples" (as Hugging Face's, or a stream
    library's): nothing to do with dtrain's batch gathering."""

    def __init__(self):
        self.rows = rows()

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {key: torch.tensor(self.rows[key][i]) for key in ("id", "input_ids", "labels")}

    def take(self, n: int) -> list[dict[str, torch.Tensor]]:
        return [self[i] for i in range(n)]


class Numbered(IterableDataset):
    """A torch iterable of numbered samples, the whole stream on every process (dtrain shards it)."""

    def __iter__(self):
        table = rows()
        for i in range(N):
            yield {key: torch.tensor(table[key][i]) for key in ("id", "input_ids", "labels")}


class Resumable(IterableDataset):
    """The numbered rows, saying its position as a torch iterable can: `load_state_dict` makes the next
    iteration continue after the last sample read (torchdata's convention, as Hugging Face's)."""

    def __init__(self):
        self.table, self.next, self.start = rows(), 0, 0

    def __iter__(self):
        self.next, self.start = self.start, 0
        while self.next < N:
            i, self.next = self.next, self.next + 1
            yield {key: torch.tensor(self.table[key][i]) for key in ("id", "input_ids", "labels")}

    def state_dict(self) -> dict:
        return {"next": self.next}

    def load_state_dict(self, state: dict) -> None:
        self.start = state["next"]


def streamed(n: int, shards: int):
    """The first n rows as a streaming datasets.IterableDataset of `shards` shards (row i in shard i mod shards)."""
    table = rows()

    def generate(mine: list[int]):
        for shard in mine:
            for i in range(shard, n, shards):
                yield {key: table[key][i] for key in ("id", "input_ids", "labels")}

    ds = datasets.IterableDataset.from_generator(generate, gen_kwargs={"mine": list(range(shards))})
    return ds.with_format("torch")


def eval_set(kind: str):
    return streamed(N_EVAL, 1) if kind == "streaming" else None


def training_set(kind: str):
    if kind == "dataset":
        return datasets.Dataset.from_dict(rows()), stack_rows
    if kind == "dataset-torch":
        ds = datasets.Dataset.from_dict(rows())
        ds.set_format("torch")
        return ds, None
    if kind == "streaming":
        return streamed(N, 4), None
    if kind == "stateful-loader":  # the user's own StatefulDataLoader: dtrain keeps its state per rank
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(Resumable(), batch_size=4), None
    if kind == "loader":  # the user's own DataLoader: its batch size, collate_fn and order are kept
        loader = DataLoader(datasets.Dataset.from_dict(rows()), batch_size=3, shuffle=False, collate_fn=stack_rows)
        return loader, None
    if kind == "own-take":
        return OwnTake(), None
    if kind == "torch-iterable":
        return Numbered(), None
    raise SystemExit(f"unknown kind {kind}")


def main() -> None:
    out, kind, overrides = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    rank = int(os.environ.get("RANK", "0"))
    config = dtrain.load_config(
        None,
        [
            f"run.dir={out / 'run'}",
            "data.batch_size=4",
            "training.grad_accum_steps=2",
            "optimizer.lr=0.01",
            "training.epochs=4",
            "training.log_every=1",
            "monitor.trackers=[]",
            *overrides,
        ],
    )
    train_data, collate_fn = training_set(kind)
    sleep_s = float(os.environ.get("DTRAIN_TEST_STEP_SLEEP_S", "0"))
    seen_file = out / f"seen-rank{rank}.json"
    evaluated_file = out / f"evaluated-rank{rank}.json"
    seen: list[list[int]] = json.loads(seen_file.read_text()) if seen_file.exists() else []
    evaluated: list[list[int]] = []

    def step_fn(model, batch):
        # Record the samples each micro-batch trained on (or evaluated), then the loss the model computes itself.
        if not model.training:  # an evaluation: its first batch after training starts a new list
            if trained_since[0]:
                evaluated.append([])
            trained_since[0] = False
            evaluated[-1].extend(batch["id"].tolist())
        else:
            trained_since[0] = True
            seen.append(batch["id"].tolist())
        time.sleep(sleep_s)
        return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

    trained_since = [True]
    eval_data = eval_set(kind)
    trainer = dtrain.Trainer(
        config, model=tiny_gpt2(), train_data=train_data, eval_data=eval_data, collate_fn=collate_fn, step_fn=step_fn
    )
    try:
        result = trainer.fit()
    finally:
        out.mkdir(parents=True, exist_ok=True)
        seen_file.write_text(json.dumps(seen))
        evaluated_file.write_text(json.dumps(evaluated))
    if rank == 0:
        (out / "facts.json").write_text(json.dumps({"loss": result.get("loss"), "steps": trainer.step}))


if __name__ == "__main__":
    main()
