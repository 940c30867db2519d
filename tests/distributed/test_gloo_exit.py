"""A finished run ends with status 0: gloo's thread is let go before Python's teardown."""

import sys

from helpers import WORKERS, ok, run


def test_a_script_whose_last_collective_ends_at_exit_exits_cleanly(tmp_path):
    """A user's script (its own gloo group, dtrain inside it) whose own last all-reduce finishes as the
    process exits, gloo's thread still to drop a tensor Python made: five rounds of two real processes,
    every rank exits with 0. Without the settling at exit (`distributed.group._let_gloo_settle_at_exit`,
    the GIL free for a moment before teardown) rank 0 dies with SIGABRT ("terminate called without an
    active exception") in every round."""
    race = [sys.executable, str(WORKERS / "exit_race.py"), "5", str(tmp_path)]
    result = ok(run(race, extra_env={"OMP_NUM_THREADS": "1"}))
    assert result.stdout.count("exit statuses [0, 0]") == 5, result.stdout
