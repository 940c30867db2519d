"""Checkpoints on an object store (checkpoint/remote.py) against a real S3 protocol server on loopback:
COMPLETE.json is the last PUT under each step-N/, a prefix without it is never taken and is cleaned,
pruning deletes COMPLETE.json first, and what comes down is checked against the manifest."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dtrain import objstore
from dtrain.checkpoint.manifest import MARKER
from dtrain.checkpoint.remote import RemoteCheckpointStore
from dtrain.checkpoint.store import CheckpointError, CheckpointStore


def sealed(run_dir, step):
    """A checkpoint as dtrain seals one: DCP's files written, then the manifest, then the rename."""
    store = CheckpointStore(run_dir)
    state = {"w": torch.arange(1000, dtype=torch.float32) * step, "b": torch.ones(3) * step}
    dcp.save(state, checkpoint_id=store.begin(step), no_dist=True)
    return store.commit(step, {"step": step, "format": 3, "samples_per_step": 1, "world_size": 1})


def puts_under(s3, since, step):
    return [p.split(f"step-{step}/", 1)[1] for m, p, _ in s3.requests()[since:] if m == "PUT" and f"step-{step}/" in p]


def test_complete_json_is_the_last_put_and_only_complete_prefixes_are_taken(s3_here, tmp_path):
    remote = RemoteCheckpointStore(s3_here.url("ckpt/order"))
    before = len(s3_here.requests())
    remote.upload(sealed(tmp_path / "a", 2))
    puts = puts_under(s3_here, before, 2)
    assert len(puts) > 2 and puts[-1] == MARKER and puts.count(MARKER) == 1, puts
    assert remote.complete() == [2]

    # A write cut short: step-4's objects are there, its COMPLETE.json is not. Never taken...
    four = sealed(tmp_path / "b", 4)
    for path in sorted(four.path.iterdir()):
        if path.name != MARKER:
            objstore.write_bytes(f"{remote.url}/step-4/{path.name}", path.read_bytes(), "run.dir")
    assert remote.complete() == [2] and remote.newest() == 2
    # ... and removed by the next start, every object of it; the complete one stays whole.
    assert remote.remove_partials() == [4]
    names = objstore.listing(remote.url, "run.dir")
    assert names and all(name.startswith("step-2/") for name in names), names


def test_a_checkpoint_comes_down_checked_and_pruning_unseals_first(s3_here, tmp_path):
    remote = RemoteCheckpointStore(s3_here.url("ckpt/prune"))
    for step in (1, 2, 3):
        remote.upload(sealed(tmp_path / "up", step))
    down = remote.download(3, tmp_path / "down")
    assert torch.equal(_load(down.path)["w"], torch.arange(1000, dtype=torch.float32) * 3)
    before = len(s3_here.requests())
    assert remote.prune(keep=1) == [1, 2]
    deletes = [p for m, p, _ in s3_here.requests()[before:] if m == "DELETE"]
    for step in (1, 2):
        mine = [d.rsplit("/", 1)[-1] for d in deletes if f"/step-{step}/" in d]
        assert mine[0] == MARKER and len(mine) > 2, mine
    assert remote.complete() == [3]

    # An object altered on the store (same size): the manifest's CRC refuses it once down, naming it.
    name = next(n for n in objstore.listing(remote.url, "run.dir") if n.endswith(".distcp"))
    data = bytearray(objstore.read_bytes(f"{remote.url}/{name}", "run.dir")[0])
    data[-1] ^= 0xFF
    objstore.write_bytes(f"{remote.url}/{name}", bytes(data), "run.dir")
    with pytest.raises(CheckpointError, match=r"checkpoint step-3 is damaged: .*corrupt \(checksum mismatch\)"):
        remote.download(3, tmp_path / "again")


def _load(path):
    state = {"w": torch.zeros(1000), "b": torch.zeros(3)}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state
