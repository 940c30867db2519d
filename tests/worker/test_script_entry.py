"""The worker entry `dtrain launch` runs in every worker, called as a user might call it by hand."""

import sys

import pytest

from helpers import WORKERS, dtrain, ok, run


def test_the_script_entry_without_a_script_is_one_line():
    for args in ([], ["-m"]):
        result = run([sys.executable, "-m", "dtrain.worker.script", *args])
        assert result.returncode == 2
        assert result.stderr.strip().splitlines() == [
            "dtrain: error: python -m dtrain.worker.script needs SCRIPT.py [ARGS...] or -m MODULE [ARGS...]"
        ]


def test_a_launched_scripts_third_party_warnings_are_said_once_not_once_per_rank(tmp_path):
    """`dtrain launch --nproc 2 script.py`: a transformers warning, a Python warning and a logging warning
    of a library the script imports each reach the console once (rank 0's), and training goes on."""
    pytest.importorskip("transformers")
    said = ok(dtrain("launch", "--nproc", "2", str(WORKERS / "warning_script.py"), str(tmp_path / "run")))
    output = said.stdout + said.stderr
    for warning in (
        "[transformers] transformers: a warning said once per process",
        "FutureWarning: noisy_library.old_api is deprecated: use new_api",
        "noisy_library: no config file found, using defaults",
    ):
        assert output.count(warning) == 1, output
    assert "step 2 | epoch 1" in output
