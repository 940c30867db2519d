"""`dtrain launch SCRIPT`: every worker runs the user's script through this module, so that its failures
are reported like a `dtrain run` worker's — once, by the launcher: the first failing rank's traceback
with its rank (not N interleaved copies), and a DtrainError raised in the script as one line, exit 2.

    python -m dtrain.worker.script SCRIPT.py [ARGS...]      as `python SCRIPT.py ARGS...`
    python -m dtrain.worker.script -m MODULE [ARGS...]      as `python -m MODULE ARGS...`
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

from dtrain import console
from dtrain.errors import DtrainError
from dtrain.worker import as_worker


def run_script(argv: Sequence[str]) -> None:
    if not argv or argv == ["-m"]:
        raise DtrainError("python -m dtrain.worker.script needs SCRIPT.py [ARGS...] or -m MODULE [ARGS...]")
    as_module = argv[0] == "-m"
    target, args = (argv[1], argv[2:]) if as_module else (argv[0], argv[1:])
    sys.argv = [target, *args]
    if as_module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as `python SCRIPT.py` does
        runpy.run_path(target, run_name="__main__")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the script `argv` (default: this command's arguments) as a worker."""
    console.outlive_the_reader()  # as `dtrain run`'s workers: a script's print never ends a stopping run
    script = list(sys.argv[1:] if argv is None else argv)
    return as_worker(lambda: run_script(script))


if __name__ == "__main__":
    sys.exit(main())
