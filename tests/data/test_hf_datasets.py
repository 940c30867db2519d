"""Data sets as their users have them: a Hugging Face `datasets.Dataset` (rows of lists with a collate_fn,
or `set_format("torch")`), a streaming `datasets.IterableDataset`, a `torch.utils.data.IterableDataset`,
and a map-style set whose `take` is not dtrain's, each trained on 2 processes by `dtrain launch`
(tests/workers/hf_data.py: a tiny GPT-2, data from local dicts and generators, nothing downloaded): the
runs a test reads on warm workers (tests/pool.py), the SIGTERM stops and the refusal under the real
launcher."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny import Resumable

from helpers import ROOT, TIMEOUT, WORKERS, dtrain, env, eval_lines, ok, train_lines, weights

pytest.importorskip("datasets")  # the test extra installs it
pytest.importorskip("transformers")

SCRIPT = str(WORKERS / "hf_data.py")
N = 48  # samples in every training set of the script


def launch(warm, out: Path, kind: str, *overrides: str) -> subprocess.CompletedProcess:
    """The script's job on the warm workers (tests/pool.py), as `dtrain launch --nproc 2` runs it."""
    return ok(warm("launch", "--nproc", "2", SCRIPT, str(out), kind, *overrides))


def seen(out: Path, rank: int) -> list[list[int]]:
    """The sample ids of each micro-batch rank `rank` trained on, in order."""
    return json.loads((out / f"seen-rank{rank}.json").read_text())


def losses(out: Path) -> list[float]:
    return [m["loss"] for m in train_lines(out / "run")]


def assert_falls(out: Path) -> None:
    curve = losses(out)
    assert len(curve) >= 6 and sum(curve[-3:]) < sum(curve[:3]), curve


def test_a_hugging_face_dataset_trains_with_the_users_collate_fn(warm, tmp_path):
    """A datasets.Dataset of Python lists (no set_format): each row through the user's collate_fn, every
    sample once an epoch across the 2 ranks, the loss falling."""
    launch(warm, tmp_path, "dataset")
    assert_falls(tmp_path)
    first_epoch = [i for rank in (0, 1) for batch in seen(tmp_path, rank)[:6] for i in batch]
    assert sorted(first_epoch) == list(range(N))


@pytest.fixture(scope="module")
def in_order(warm, tmp_path_factory):
    """The torch-formatted set unshuffled, start to finish: also the reference a torch iterable of the same
    rows in the same order must match bitwise."""
    out = tmp_path_factory.mktemp("in_order")
    launch(warm, out, "dataset-torch", "data.shuffle=false")
    return out


def test_a_torch_formatted_dataset_in_its_own_order_with_shuffle_false(in_order):
    """set_format("torch") and the default collation; data.shuffle = false gives the data set's order:
    rank r trains on samples r, r + 2, r + 4, ... every epoch."""
    assert_falls(in_order)
    for rank in (0, 1):
        order = [i for batch in seen(in_order, rank) for i in batch]
        assert order == list(range(rank, N, 2)) * 4


def test_a_data_set_with_a_take_of_its_own_goes_through_the_general_path(warm, tmp_path):
    """Its take(n) ("the first n samples") is not dtrain's batch gatherer: samples are read one by one and
    collated, every sample once an epoch, and the model trains."""
    launch(warm, tmp_path, "own-take")
    assert_falls(tmp_path)
    first_epoch = [i for rank in (0, 1) for batch in seen(tmp_path, rank)[:6] for i in batch]
    assert sorted(first_epoch) == list(range(N))


def test_a_dataloader_handed_in_keeps_its_batch_size_collate_fn_and_order(warm, tmp_path):
    """Trainer(train_data=DataLoader(rows, batch_size=3, shuffle=False, collate_fn=...)): the loader's batch
    size (not data.batch_size = 4), its collate_fn (rows of lists cannot be collated without it) and its
    unshuffled order, with dtrain's rank shard added: rank r trains on r, r + 2, ... every epoch."""
    launch(warm, tmp_path, "loader")
    assert_falls(tmp_path)
    assert [m["step"] for m in train_lines(tmp_path / "run")] == list(range(1, 17))  # 8 batches of 3 an epoch
    for rank in (0, 1):
        batches = seen(tmp_path, rank)
        assert {len(batch) for batch in batches} == {3}
        assert [i for batch in batches for i in batch] == list(range(rank, N, 2)) * 4


# --- iterable data ------------------------------------------------------------------------------------

# 4 shards, 2 a rank, read by 2 DataLoader workers (one shard each): 3 steps a pass on each rank, 4 passes;
# a streamed eval set of 21 rows (11 and 10 a rank) evaluated at steps 6 and 12.
STREAM = ("streaming", "training.max_steps=12", "data.num_workers=2", "training.eval_every_steps=6")
N_EVAL = 21


@pytest.fixture(scope="module")
def streamed(warm, tmp_path_factory):
    """The streaming run start to finish, uninterrupted."""
    out = tmp_path_factory.mktemp("streamed")
    launch(warm, out, *STREAM)
    return out


def test_a_streaming_dataset_trains_pass_after_pass_on_each_ranks_share(streamed):
    """split_dataset_by_node gives each rank 2 of the 4 shards, each DataLoader worker one; a pass is all
    of the rank's share: across the ranks every sample once a pass, for training.max_steps through 4
    passes, the loss falling."""
    assert_falls(streamed)
    assert [m["step"] for m in train_lines(streamed / "run")] == list(range(1, 13))
    for pass_ in range(4):
        ids = [i for rank in (0, 1) for batch in seen(streamed, rank)[pass_ * 6 : pass_ * 6 + 6] for i in batch]
        assert sorted(ids) == list(range(N)), (pass_, ids)


def test_a_streamed_eval_set_is_evaluated_whole_each_sample_once_as_a_map_style_set_would_be(streamed):
    """eval_data a streaming IterableDataset of 21 rows on 2 ranks (11 and 10): each evaluation reads
    every row once across the ranks, the same rows every time, and its eval_loss is the loss of the
    trained model over those rows as one map-style batch (the mean over samples of the step_fn's loss)."""
    from datasets import Dataset
    from hf_gpt2 import tiny_gpt2

    evals = [json.loads((streamed / f"evaluated-rank{rank}.json").read_text()) for rank in (0, 1)]
    assert len(evals[0]) == len(evals[1]) == 2  # steps 6 and 12
    for at in range(2):
        assert sorted(evals[0][at] + evals[1][at]) == list(range(N_EVAL))
        assert (len(evals[0][at]), len(evals[1][at])) == (11, 10)
    last = eval_lines(streamed / "run")[-1]
    assert last["step"] == 12 and last["eval_samples"] == N_EVAL
    sys.path.insert(0, str(WORKERS))
    from hf_data import rows

    table = Dataset.from_dict(rows()).select(range(N_EVAL)).with_format("torch")
    model = tiny_gpt2()
    trained = weights(streamed / "run")
    trained.setdefault("transformer.wte.weight", trained["lm_head.weight"])  # tied: saved once
    model.load_state_dict(trained)
    model.eval()
    with torch.no_grad():  # each row's loss alone (the batches' means weighted by their samples)
        each = [model(input_ids=r["input_ids"][None], labels=r["labels"][None]).loss.double() for r in table]
    assert last["eval_loss"] == pytest.approx(float(torch.stack(each).mean()), rel=1e-5)


def wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def stop_by_sigterm(out: Path, *args: str, after_step: int = 4) -> int:
    """Launch, SIGTERM it after `after_step` steps; the steps it had taken (its checkpoint's)."""
    command = [sys.executable, "-m", "dtrain", "launch", "--nproc", "2", SCRIPT, str(out), *args]
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env(DTRAIN_TEST_STEP_SLEEP_S="0.3"), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    metrics = out / "run" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(train_lines(out / "run")) >= after_step, f"step {after_step}")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 75, err.decode()
    return len(seen(out, 0)) // 2  # 2 micro-batches a step


def assert_resumed_exactly(warm, out: Path, reference: Path, *args: str) -> None:
    """Stopped mid-pass by SIGTERM, then rerun: the checkpoint held each rank's position, the rerun went on
    from the next batch and ended bitwise where the uninterrupted `reference` did."""
    stopped_at = stop_by_sigterm(out, *args)
    assert 4 <= stopped_at < 12 and stopped_at % 3, stopped_at  # inside a pass
    resumed = launch(warm, out, *args)
    assert "resumed from" in resumed.stderr and "starts again" not in resumed.stderr
    ref, run = weights(reference / "run"), weights(out / "run")
    assert all(torch.equal(ref[k], run[k]) for k in ref)
    assert losses(out) == losses(reference)
    for rank in (0, 1):  # the interrupted run's micro-batches, then the resumed run's: the same as uninterrupted
        assert seen(out, rank) == seen(reference, rank)


def test_a_streaming_run_stopped_by_sigterm_resumes_exactly(warm, streamed, tmp_path):
    """Each worker's position in its shard (Hugging Face's state_dict, gathered by torchdata's
    StatefulDataLoader with the worker next in turn) is checkpointed per rank and restored."""
    assert_resumed_exactly(warm, tmp_path, streamed, *STREAM)


def test_a_stateful_dataloader_of_a_torch_iterable_resumes_exactly_as_the_map_style_run(warm, in_order, tmp_path):
    """A torchdata StatefulDataLoader handed in, over a torch IterableDataset with state_dict() of the same
    rows in the same order as the unshuffled map-style run: dtrain shards it by rank (rank r: r, r + 2, ...),
    keeps each rank's position, and the run stopped by SIGTERM mid-pass and resumed is bitwise the
    map-style run."""
    assert_resumed_exactly(warm, tmp_path, in_order, "stateful-loader", "training.max_steps=12")


def test_an_iterable_that_cannot_say_its_position_restarts_the_pass_and_says_so(warm, tmp_path):
    """A torch IterableDataset without state_dict() yields the whole stream on every process: dtrain keeps
    each sample on one rank and one of 2 DataLoader workers, each sample once a pass. Stopped mid-pass
    (training.stop_at_step), it resumes at the start of that pass and says so in one line."""
    args = ("torch-iterable", "training.max_steps=6", "data.num_workers=2")
    launch(warm, tmp_path, *args, "training.stop_at_step=4")
    before = {rank: seen(tmp_path, rank) for rank in (0, 1)}
    resumed = launch(warm, tmp_path, *args)
    said = [line for line in resumed.stderr.splitlines() if "starts again" in line]
    assert len(said) == 1 and "resuming at step 4" in said[0] and "pass 2" in said[0], resumed.stderr
    for rank in (0, 1):
        after = seen(tmp_path, rank)[len(before[rank]) :]
        assert after == before[rank][:4]  # pass 2 from its first micro-batch: as pass 1 began
    first_pass = [i for rank in (0, 1) for batch in before[rank][:6] for i in batch]
    assert sorted(first_pass) == list(range(N))


def test_an_iterable_without_max_steps_is_refused_in_one_line(tmp_path):
    result = dtrain("launch", "--nproc", "2", SCRIPT, str(tmp_path), "streaming")
    lines = [line for line in result.stderr.splitlines() if "training.max_steps" in line]
    assert result.returncode != 0 and len(lines) == 1, result.stderr
    assert "iterable data set" in lines[0]


class Counting(torch.utils.data.IterableDataset):
    """0, 1, ..., n - 1, the whole stream in every process and every DataLoader worker."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return iter(torch.arange(self.n))


@pytest.mark.parametrize("workers", [0, 2])
def test_on_one_process_dataloader_workers_split_a_torch_iterable_too(workers):
    """One process, W workers: each worker keeps every W-th sample, so a pass holds each sample once."""
    from dtrain.config import DataConfig
    from dtrain.data.streams import StreamBatches

    data = DataConfig(batch_size=4, num_workers=workers)
    stream = StreamBatches(Counting(24), data, 1, 6, 0, 1, torch.device("cpu")).stream(0)
    ids = [int(i) for _ in range(6) for i in next(stream)[0]]
    stream.close()  # its DataLoader workers end here, not when some later test's garbage is collected
    assert sorted(ids) == list(range(24))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_torch_iterable_that_says_its_position_resumes_on_its_rank_and_worker(workers):
    """Rank 1 of 2 with W workers: the position taken after any step (through JSON, as the checkpoint
    keeps it) and loaded into a fresh stream continues with the very batches of an unbroken one,
    across the end of a pass too (40 samples: 20 a rank; 2 workers: 3 + 3 + 3 + 1 each a pass)."""
    from dtrain.config import DataConfig
    from dtrain.data.streams import StreamBatches

    def run(stop_at: int | None) -> list[list[int]]:
        make = lambda: StreamBatches(  # noqa: E731
            Resumable(40), DataConfig(batch_size=3, num_workers=workers), 1, 12, 1, 2, torch.device("cpu")
        )
        stream = make()
        batches, out = stream.stream(0), []
        for step in range(12):
            if step == stop_at:
                state = json.loads(json.dumps(stream.position.state_dict()))
                batches.close()
                stream = make()
                stream.position.load_state_dict(state)
                batches = stream.stream(step)
            out.append(next(batches)[0].tolist())
        batches.close()
        return out

    unbroken = run(None)
    width = max(workers, 1)  # rank 1's share: i ≡ 1 × W + worker (mod 2W)
    share = [i for i in range(40) if width <= i % (2 * width)]
    assert sorted([i for batch in unbroken for i in batch][:20]) == share  # the first pass
    for stop_at in (3, 7):
        assert run(stop_at) == unbroken, stop_at


def test_a_capped_iterable_eval_set_reads_the_same_samples_every_time_split_across_ranks():
    """training.eval_batches = 3 at eval_batch_size 4 on 2 ranks: 12 samples in all, 6 of each rank's share,
    the same at every evaluation; uncapped, every sample once across the ranks."""
    from dtrain.config import DataConfig
    from dtrain.data.stream_eval import StreamEvalBatches

    data = DataConfig(eval_batch_size=4)

    def ids(cap: int) -> list[list[int]]:
        shares = [StreamEvalBatches(Counting(21), rank, 2, data, torch.device("cpu"), None, cap) for rank in (0, 1)]
        return [[int(i) for batch in share for i in batch] for share in shares]

    capped = ids(3)
    assert capped == ids(3) and [len(share) for share in capped] == [6, 6]
    assert capped == [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 11]]
    assert sorted(ids(0)[0] + ids(0)[1]) == list(range(21))
