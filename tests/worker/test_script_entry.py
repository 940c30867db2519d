"""The worker entry `dtrain launch` runs in every worker, called as a user might call it by hand."""

import sys

from helpers import run


def test_the_script_entry_without_a_script_is_one_line():
    for args in ([], ["-m"]):
        result = run([sys.executable, "-m", "dtrain.worker.script", *args])
        assert result.returncode == 2
        assert result.stderr.strip().splitlines() == [
            "dtrain: error: python -m dtrain.worker.script needs SCRIPT.py [ARGS...] or -m MODULE [ARGS...]"
        ]
