"""Data sets as their users have them: a Hugging Face `datasets.Dataset` (rows of lists with a collate_fn,
or `set_format("torch")`), a streaming `datasets.IterableDataset`, a `torch.utils.data.IterableDataset`,
and a map-style set whose `take` is not dtrain's, each trained on 2 processes by `dtrain launch`
(tests/workers/hf_data.py: a tiny GPT-2, data from local dicts and generators, nothing downloaded)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import ROOT, TIMEOUT, WORKERS, dtrain, env, ok, train_lines, weights

pytest.importorskip("datasets")  # the test extra installs it
pytest.importorskip("transformers")

SCRIPT = str(WORKERS / "hf_data.py")
N = 48  # samples in every training set of the script


def launch(out: Path, kind: str, *overrides: str) -> subprocess.CompletedProcess:
    return ok(dtrain("launch", "--nproc", "2", SCRIPT, str(out), kind, *overrides))


def seen(out: Path, rank: int) -> list[list[int]]:
    """The sample ids of each micro-batch rank `rank` trained on, in order."""
    return json.loads((out / f"seen-rank{rank}.json").read_text())


def losses(out: Path) -> list[float]:
    return [m["loss"] for m in train_lines(out / "run")]


def assert_falls(out: Path) -> None:
    curve = losses(out)
    assert len(curve) >= 6 and sum(curve[-3:]) < sum(curve[:3]), curve


def test_a_hugging_face_dataset_trains_with_the_users_collate_fn(tmp_path):
    """A datasets.Dataset of Python lists (no set_format): each row through the user's collate_fn, every
    sample once an epoch across the 2 ranks, the loss falling."""
    launch(tmp_path, "dataset")
    assert_falls(tmp_path)
    first_epoch = [i for rank in (0, 1) for batch in seen(tmp_path, rank)[:6] for i in batch]
    assert sorted(first_epoch) == list(range(N))


def test_a_torch_formatted_dataset_in_its_own_order_with_shuffle_false(tmp_path):
    """set_format("torch") and the default collation; data.shuffle = false gives the data set's order:
    rank r trains on samples r, r + 2, r + 4, ... every epoch."""
    launch(tmp_path, "dataset-torch", "data.shuffle=false")
    assert_falls(tmp_path)
    for rank in (0, 1):
        order = [i for batch in seen(tmp_path, rank) for i in batch]
        assert order == list(range(rank, N, 2)) * 4


def test_a_data_set_with_a_take_of_its_own_goes_through_the_general_path(tmp_path):
    """Its take(n) ("the first n samples") is not dtrain's batch gatherer: samples are read one by one and
    collated, every sample once an epoch, and the model trains."""
    launch(tmp_path, "own-take")
    assert_falls(tmp_path)
    first_epoch = [i for rank in (0, 1) for batch in seen(tmp_path, rank)[:6] for i in batch]
    assert sorted(first_epoch) == list(range(N))


def test_a_dataloader_handed_in_keeps_its_batch_size_collate_fn_and_order(tmp_path):
    """Trainer(train_data=DataLoader(rows, batch_size=3, shuffle=False, collate_fn=...)): the loader's batch
    size (not data.batch_size = 4), its collate_fn (rows of lists cannot be collated without it) and its
    unshuffled order, with dtrain's rank shard added: rank r trains on r, r + 2, ... every epoch."""
    launch(tmp_path, "loader")
    assert_falls(tmp_path)
    assert [m["step"] for m in train_lines(tmp_path / "run")] == list(range(1, 17))  # 8 batches of 3 an epoch
    for rank in (0, 1):
        batches = seen(tmp_path, rank)
        assert {len(batch) for batch in batches} == {3}
        assert [i for batch in batches for i in batch] == list(range(rank, N, 2)) * 4


# --- iterable data ------------------------------------------------------------------------------------

STREAM = ("streaming", "training.max_steps=12")  # 3 steps a pass on each rank: 4 passes


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    """The streaming run start to finish, uninterrupted."""
    out = tmp_path_factory.mktemp("streamed")
    launch(out, *STREAM)
    return out


def test_a_streaming_dataset_trains_pass_after_pass_on_each_ranks_share(streamed):
    """split_dataset_by_node gives each rank every other sample; a pass is all of its share, in order;
    the run goes on for training.max_steps through 4 passes, the loss falling."""
    assert_falls(streamed)
    assert [m["step"] for m in train_lines(streamed / "run")] == list(range(1, 13))
    for rank in (0, 1):
        order = [i for batch in seen(streamed, rank) for i in batch]
        assert order == list(range(rank, N, 2)) * 4


def wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_streaming_run_stopped_by_sigterm_resumes_exactly(streamed, tmp_path):
    """SIGTERM mid-pass: a checkpoint holding each rank's position in its stream (the data set's own
    state_dict); the rerun continues at the next sample, and ends bitwise where the uninterrupted run did."""
    args = [sys.executable, "-m", "dtrain", "launch", "--nproc", "2", SCRIPT, str(tmp_path), *STREAM]
    proc = subprocess.Popen(
        args, cwd=ROOT, env=env(DTRAIN_TEST_STEP_SLEEP_S="0.3"), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 4, "step 4")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 75, err.decode()
    stopped_at = len(seen(tmp_path, 0)) // 2  # 2 micro-batches a step
    assert 4 <= stopped_at < 12, stopped_at
    resumed = launch(tmp_path, *STREAM)
    assert "resumed from" in resumed.stderr and "starts again" not in resumed.stderr
    ref, run = weights(streamed / "run"), weights(tmp_path / "run")
    assert all(torch.equal(ref[k], run[k]) for k in ref)
    assert losses(tmp_path) == losses(streamed)
    for rank in (0, 1):  # the interrupted run's micro-batches, then the resumed run's: the same as uninterrupted
        assert seen(tmp_path, rank) == seen(streamed, rank)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_torch_iterable_is_sharded_by_rank_and_worker_each_sample_once_a_pass(workers, tmp_path):
    """A torch IterableDataset yields the whole stream on every process: dtrain keeps each sample on one
    rank (and one DataLoader worker): over each pass, each sample is trained on exactly once."""
    launch(tmp_path, "torch-iterable", "training.max_steps=6", f"data.num_workers={workers}")
    for pass_ in (0, 1):
        ids = [i for rank in (0, 1) for batch in seen(tmp_path, rank)[pass_ * 6 : pass_ * 6 + 6] for i in batch]
        assert sorted(ids) == list(range(N)), (pass_, ids)


def test_an_iterable_that_cannot_say_its_position_restarts_the_pass_and_says_so(tmp_path):
    """Stopped mid-pass (training.stop_at_step), a torch iterable without state_dict() resumes at the start
    of that pass, and the resumed run says so in one line."""
    launch(tmp_path, "torch-iterable", "training.max_steps=6", "training.stop_at_step=4")
    before = {rank: seen(tmp_path, rank) for rank in (0, 1)}
    resumed = launch(tmp_path, "torch-iterable", "training.max_steps=6")
    said = [line for line in resumed.stderr.splitlines() if "starts again" in line]
    assert len(said) == 1 and "resuming at step 4" in said[0] and "pass 2" in said[0], resumed.stderr
    for rank in (0, 1):
        after = seen(tmp_path, rank)[len(before[rank]) :]
        assert after == before[rank][:4]  # pass 2 from its first micro-batch: as pass 1 began


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
    assert sorted(ids) == list(range(24))
