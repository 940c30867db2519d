"""objstore's write side against a real S3 protocol server on loopback (tests/s3server.py): whole-object
writes, the conditional ones a lease is taken with, one recursive listing, ordered removal, and a store's
refusals as one line. Nothing of fsspec, s3fs or boto is mocked."""

import pytest

from dtrain import objstore


def test_an_object_written_is_read_back_with_its_etag(s3_here):
    url = s3_here.url("objstore/plain/a.json")
    etag = objstore.write_bytes(url, b'{"a": 1}', "run.dir")
    assert objstore.read_bytes(url, "run.dir") == (b'{"a": 1}', etag) and etag
    with pytest.raises(FileNotFoundError):
        objstore.read_bytes(s3_here.url("objstore/plain/none.json"), "run.dir")


def test_of_two_conditional_writers_exactly_one_wins(s3_here):
    url = s3_here.url("objstore/cond/lease.json")
    first = objstore.write_bytes(url, b"first", "run.dir", if_absent=True)
    with pytest.raises(objstore.Conflict):  # If-None-Match: it is there now
        objstore.write_bytes(url, b"second", "run.dir", if_absent=True)
    renewed = objstore.write_bytes(url, b"renewed", "run.dir", if_etag=first)  # still the one we wrote
    with pytest.raises(objstore.Conflict):  # If-Match on the stale ETag: someone wrote meanwhile
        objstore.write_bytes(url, b"stale", "run.dir", if_etag=first)
    assert objstore.read_bytes(url, "run.dir") == (b"renewed", renewed)


def test_a_listing_is_recursive_uncached_and_relative_and_removal_keeps_order(s3_here):
    prefix = s3_here.url("objstore/list")
    assert objstore.listing(prefix, "run.dir") == {}
    for name, data in [("checkpoints/step-2/a.distcp", b"xx"), ("checkpoints/step-2/COMPLETE.json", b"{}")]:
        objstore.write_bytes(f"{prefix}/{name}", data, "run.dir")
    assert objstore.listing(prefix, "run.dir") == {
        "checkpoints/step-2/COMPLETE.json": 2,
        "checkpoints/step-2/a.distcp": 2,
    }
    objstore.write_bytes(f"{prefix}/metrics.jsonl", b"{}\n", "run.dir")  # seen at once: no stale cache
    assert "metrics.jsonl" in objstore.listing(prefix, "run.dir")
    before = len(s3_here.requests())
    objstore.remove(
        [f"{prefix}/checkpoints/step-2/COMPLETE.json", f"{prefix}/checkpoints/step-2/a.distcp", f"{prefix}/gone"],
        "run.dir",
    )
    deletes = [path for method, path, _ in s3_here.requests()[before:] if method == "DELETE"]
    assert [d.rsplit("/", 1)[-1] for d in deletes] == ["COMPLETE.json", "a.distcp", "gone"]
    assert objstore.listing(prefix, "run.dir") == {"metrics.jsonl": 3}


def test_a_missing_bucket_and_refused_credentials_are_one_line(s3_here, monkeypatch):
    with pytest.raises(
        objstore.StorageError, match=r"^run\.dir = 's3://no-such-bucket/x/a': bucket 'no-such-bucket' does not exist"
    ):
        objstore.read_bytes("s3://no-such-bucket/x/a", "run.dir")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    with pytest.raises(objstore.StorageError) as refused:
        objstore.write_bytes(s3_here.url("objstore/creds/a"), b"x", "run.dir")
    assert "refused these credentials" in str(refused.value) and "wrong" not in str(refused.value)
    assert len(str(refused.value).splitlines()) == 1
