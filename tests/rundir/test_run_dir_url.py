"""run.dir on object storage: until every output of a run can be written to a store with its checkpoints'
COMPLETE.json last, `run.dir = s3://...` is refused in one line before anything is written anywhere
(rather than written as a local folder named "s3:", or half to the store)."""

import sys

import pytest

from helpers import ROOT, run


@pytest.mark.parametrize("url", ["s3://bucket/runs/first", "gs://bucket/run", "s3://KEY:SE/CRET@bucket/run"])
def test_a_run_dir_url_is_refused_in_one_line_and_nothing_is_written(tmp_path, url):
    config = ROOT / "examples" / "digits_mlp.toml"
    result = run([sys.executable, "-m", "dtrain", "run", str(config), f"run.dir={url}"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "not supported for run.dir yet" in lines[0], lines
    assert "CRET" not in result.stderr + result.stdout  # a password in the URL is never echoed
    assert list(tmp_path.iterdir()) == []  # no local folder named "s3:" (a URL taken for a path)
