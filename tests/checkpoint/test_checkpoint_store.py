"""The checkpoint folder rules, on real files: sealing, choosing, pruning, verifying, locking."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dtrain.checkpoint import CheckpointError, CheckpointStore
from dtrain.checkpoint.store import MARKER
from dtrain.errors import DtrainError
from dtrain.observe.metrics_file import truncate_metrics
from dtrain.rundir.lock import RunDirLock


def write_checkpoint(store: CheckpointStore, step: int, payload: bytes = b"x" * 100):
    folder = store.begin(step)
    (folder / "data.bin").write_bytes(payload)
    return store.commit(step, {"step": step, "world_size": 2})


def test_only_sealed_checkpoints_count_and_the_newest_wins(tmp_path):
    store = CheckpointStore(tmp_path)
    for step in (5, 10, 20):
        write_checkpoint(store, step)
    store.begin(30)  # an interrupted write: no marker, partial name
    (store.root / "step-40").mkdir()  # a folder without its marker is never chosen
    assert [c.step for c in store.complete()] == [5, 10, 20]
    assert store.newest().step == 20
    assert store.remove_partials() == [store.partial_path(30)]
    assert (store.root / "step-40").exists()  # not ours to delete


def test_keep_k_never_deletes_the_newest_and_ignores_partials(tmp_path):
    store = CheckpointStore(tmp_path)
    for step in (1, 2, 3, 4):
        write_checkpoint(store, step)
    store.begin(5)
    (store.partial_path(5) / "data.bin").write_bytes(b"half")
    assert [c.step for c in store.prune(keep=2)] == [1, 2]
    assert [c.step for c in store.complete()] == [3, 4]
    assert store.partial_path(5).exists()  # a write in progress is not a checkpoint to prune
    store.prune(keep=1)
    assert [c.step for c in store.complete()] == [4]


def test_the_same_step_written_again_replaces_the_old_one_whole(tmp_path):
    store = CheckpointStore(tmp_path)
    write_checkpoint(store, 7, b"old")
    write_checkpoint(store, 7, b"new!")
    assert (store.root / "step-7" / "data.bin").read_bytes() == b"new!"
    assert not list(store.root.glob(".partial-*"))


@pytest.mark.parametrize(
    "damage, words",
    [
        ("flip", "is corrupt (checksum mismatch)"),
        ("cut", "is truncated or altered (50 bytes, 100 expected)"),
        ("delete", "is missing"),
    ],
)
def test_a_damaged_file_is_named_with_the_fix(tmp_path, damage, words):
    store = CheckpointStore(tmp_path)
    write_checkpoint(store, 1)
    newest = write_checkpoint(store, 2)
    target = newest.path / "data.bin"
    if damage == "flip":
        target.write_bytes(b"y" * 100)
    elif damage == "cut":
        target.write_bytes(b"x" * 50)
    else:
        target.unlink()
    with pytest.raises(CheckpointError) as info:
        store.check_intact(newest)
    assert str(info.value) == (
        f"checkpoint step-2 is damaged: {target} {words}; delete {newest.path} to resume from step-1"
    )
    assert store.check_intact(store.complete()[0])["step"] == 1  # the previous one is fine


def test_the_marker_lists_every_file(tmp_path):
    store = CheckpointStore(tmp_path)
    checkpoint = write_checkpoint(store, 3)
    meta = json.loads((checkpoint.path / MARKER).read_text())
    assert meta["files"] == {"data.bin": {"bytes": 100, "crc32": meta["files"]["data.bin"]["crc32"]}}


def test_the_run_dir_lock_is_exclusive_and_dies_with_its_holder(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time; from pathlib import Path; from dtrain.rundir.lock import RunDirLock; "
                f"RunDirLock(Path({str(tmp_path)!r})).acquire(); print('locked', flush=True); time.sleep(60)"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(DtrainError, match=rf"run.dir {tmp_path} is in use by another run \(pid {holder.pid} on "):
            RunDirLock(tmp_path).acquire()
        with pytest.raises(DtrainError, match="in use by another run"):
            RunDirLock(tmp_path).check_free()
    finally:
        holder.kill()
        holder.wait()
    lock = RunDirLock(tmp_path)  # the kernel dropped the dead holder's lock
    lock.acquire()
    lock.release()


def _holder(tmp_path, body: str) -> subprocess.Popen:
    """A process that takes the run.dir lock, runs `body` (python, `lock_fd` in scope) and prints `ready`."""
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, json, os, socket, sys, time\n"
            "from pathlib import Path\n"
            "from dtrain.rundir.lock import RunDirLock\n"
            f"lock = RunDirLock(Path({str(tmp_path)!r})); lock.acquire(); lock_fd = lock._fd\n"
            f"{body}\n"
            "print('ready', flush=True); time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )


def test_a_lock_a_killed_holder_has_not_yet_let_go_of_is_waited_for_not_refused(tmp_path):
    """The kernel drops a killed run's lock only once every thread and process sharing its file has closed
    it: a rerun that comes in between waits for that instead of calling the dead run "in use". Here a
    process the holder forked with the file open (by hand, not through the lock) lingers a second."""
    holder = _holder(tmp_path, "if os.fork() == 0:\n    time.sleep(1); os._exit(0)")
    assert holder.stdout.readline().strip() == "ready"
    holder.kill()
    holder.wait()
    lock = RunDirLock(tmp_path)
    lock.acquire()  # refused at once before: the recorded holder is gone, its child still held the file
    lock.release()


def test_a_process_forked_by_the_holder_does_not_keep_the_run_dir_locked(tmp_path):
    """A DataLoader worker forked by rank 0 does not hold the run.dir lock: once rank 0 is gone, the lock
    is free though the child lingers on (for a minute here; DataLoader workers take seconds to notice)."""
    holder = _holder(tmp_path, "child = os.fork()\nif child == 0:\n    time.sleep(60); os._exit(0)\nprint(child)")
    child = int(holder.stdout.readline())
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(DtrainError, match="in use by another run"):
            RunDirLock(tmp_path).check_free()  # the holder is alive: refused
        holder.kill()
        holder.wait()
        RunDirLock(tmp_path).check_free()  # with the child still alive
        assert Path(f"/proc/{child}").exists()
    finally:
        os.kill(child, signal.SIGKILL)


def test_a_refused_start_leaves_no_run_dir_behind(tmp_path):
    lock = RunDirLock(tmp_path / "new")
    lock.acquire()
    lock.release(remove_if_created=True)
    assert not (tmp_path / "new").exists()


def test_metrics_are_cut_back_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [
        {"step": 5, "loss": 1},
        {"step": 6, "eval_loss": 1},
        {"step": 10, "loss": 2},
        {"step": 10, "eval_loss": 2},
        {"step": 12, "loss": 3},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 13, "lo')  # cut short
    truncate_metrics(path, 10, drop_eval_at_step=True)
    assert [json.loads(l) for l in path.read_text().splitlines()] == lines[:3]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    truncate_metrics(path, 10, drop_eval_at_step=False)
    assert [json.loads(l) for l in path.read_text().splitlines()] == lines[:4]


def test_a_folder_not_named_as_dtrain_names_it_is_not_a_checkpoint(tmp_path):
    store = CheckpointStore(tmp_path)
    write_checkpoint(store, 15)
    (store.root / "step-15").rename(store.root / "step-015")  # renamed by hand
    assert store.complete() == []


@pytest.mark.parametrize(
    "marker, problem",
    [
        (None, "not a JSON object"),
        ([], "not a JSON object"),
        ({"step": 7, "world_size": 2, "files": {}}, "it says step 7"),
        ({"step": 3, "world_size": 0, "files": {}}, "world_size 0"),
        ({"step": 3, "world_size": 2, "files": {"data.bin": {"bytes": "100"}}}, "its file list is malformed"),
        ({"step": 3, "world_size": 2, "files": []}, "its file list is malformed"),
    ],
)
def test_a_marker_of_the_wrong_shape_is_refused_in_one_line(tmp_path, marker, problem):
    store = CheckpointStore(tmp_path)
    checkpoint = write_checkpoint(store, 3)
    (checkpoint.path / MARKER).write_text(json.dumps(marker))
    with pytest.raises(CheckpointError) as caught:
        store.check_intact(checkpoint)
    assert str(caught.value) == (
        f"{checkpoint.path / MARKER} is not a marker dtrain wrote ({problem}); delete "
        f"{checkpoint.path} and rerun with run.overwrite=true to start over"
    )


def test_a_marker_that_omits_a_file_is_refused(tmp_path):
    store = CheckpointStore(tmp_path)
    checkpoint = write_checkpoint(store, 3)
    meta = json.loads((checkpoint.path / MARKER).read_text())
    del meta["files"]["data.bin"]
    (checkpoint.path / MARKER).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"data.bin is not in its manifest \(the marker omits it\)"):
        store.check_intact(checkpoint)
