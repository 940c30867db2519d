"""run.dir's lock on an object store is a lease object (rundir/lease.py), against a real S3 protocol server
on loopback: one holder at a time, renewed while it lives, taken over (with a line saying so) once a dead
holder's lease has expired, and of two runs taking over the same dead lease exactly one wins."""

import json
import re
import subprocess
import sys
import threading
import time

import pytest

from dtrain import objstore
from dtrain.errors import DtrainError
from dtrain.rundir.lease import RunDirLease
from helpers import env

HOLD = """
import sys, time
from dtrain.rundir.lease import RunDirLease
RunDirLease(sys.argv[1], run="dead", term_s=600).acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_one_holder_renewed_while_it_lives_and_free_once_released(s3_here):
    url = s3_here.url("lease/live")
    lease = RunDirLease(url, run="first", term_s=3.0)
    lease.acquire()
    try:
        held = json.loads(objstore.read_bytes(f"{url}/.lease", "run.dir")[0])
        assert held["run"] == "first" and held["pid"] and held["host"]
        time.sleep(4)  # past its first term: renewed meanwhile, so still not free
        with pytest.raises(DtrainError, match=r"^run\.dir s3://\S+/lease/live is in use by another run \(pid \d+ on"):
            RunDirLease(url, term_s=3.0).acquire()
        assert json.loads(objstore.read_bytes(f"{url}/.lease", "run.dir")[0])["expires"] > held["expires"]
        assert not lease.lost
    finally:
        lease.release()
    assert objstore.listing(url, "run.dir") == {}  # released: the object is gone
    RunDirLease(url).check_free()


def test_a_killed_holders_lease_is_taken_over_once_expired_by_exactly_one_run(s3_here, tmp_path):
    url = s3_here.url("lease/dead")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, url], env=env(**s3_here.env), stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        holder.kill()  # kill -9: no release, no more renewals
        holder.wait()
        with pytest.raises(DtrainError, match="in use by another run"):  # not expired yet
            RunDirLease(url).check_free()
        # Its term passing, without the wait: the lease as the store would hold it an hour later.
        fs = s3_here.filesystem()
        held = json.loads(fs.cat_file(f"{url[5:]}/.lease"))
        fs.pipe_file(f"{url[5:]}/.lease", json.dumps({**held, "expires": held["expires"] - 3600}).encode())
        takers = [RunDirLease(url, run=f"taker-{i}") for i in range(2)]
        outcomes: list[object] = [None, None]

        def take(i: int) -> None:
            try:
                takers[i].acquire()
                outcomes[i] = "won"
            except DtrainError as exc:
                outcomes[i] = str(exc)

        threads = [threading.Thread(target=take, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(map(str, outcomes))[-1] == "won" and outcomes.count("won") == 1, outcomes
        winner = takers[outcomes.index("won")]
        assert winner.took_over.startswith(f"took over the lease on run.dir from pid {holder.pid} on ")
        assert "run dead" in winner.took_over and "expired at" in winner.took_over
        winner.release()
    finally:
        holder.kill()


def test_renewals_failing_for_longer_than_the_term_lose_the_lease_and_say_so_once(s3_here):
    """A store that stops taking the renewals (here: its bucket deleted under the run) is a lease lost once
    the term has passed: another run may take it from then on. The run is told (on_lost), once."""
    import boto3

    store = boto3.client(
        "s3", endpoint_url=s3_here.endpoint, aws_access_key_id=s3_here.key, aws_secret_access_key=s3_here.secret
    )
    store.create_bucket(Bucket="dtrain-lease-gone")
    url = "s3://dtrain-lease-gone/run"
    told: list[str] = []
    lease = RunDirLease(url, run="first", term_s=1.5, on_lost=told.append)
    lease.acquire()
    try:
        store.delete_object(Bucket="dtrain-lease-gone", Key="run/.lease")  # then the bucket: renewals fail
        store.delete_bucket(Bucket="dtrain-lease-gone")
        deadline = time.time() + 20
        while not lease.lost and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # a renewal more would say it again
    finally:
        lease.release()
    assert lease.lost and not lease.held and len(told) == 1, told
    assert re.match(
        r"run\.dir s3://dtrain-lease-gone/run: its lease could not be renewed for \d+ s, longer than its 1\.5 s "
        r"term \(last: .*\), so another run may own run\.dir now$",
        told[0],
    ), told
