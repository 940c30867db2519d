"""SIGTERM (or Ctrl-C) before training begins: exit 75 (130) with dtrain's own line, not 143 or a
KeyboardInterrupt traceback in the middle of an import.

A scheduler may stop a job at any moment, also in its first second, while torch is still importing.
The command line installs this handler first thing, before any heavy import: nothing has been written
yet, so there is nothing to save and the process may end at once (os._exit: no teardown of a
half-imported torch; a run.dir lock taken by the launcher's checks is a flock the kernel drops). The
Trainer's StopRequest replaces it before anything is written to run.dir. `dtrain run` (launcher and
workers) and every worker of dtrain's launcher take Ctrl-C here too (torchrun passes the launcher's SIGINT
on to its workers); other commands keep Python's KeyboardInterrupt. Once the Trainer lets go, a dtrain
worker's process ends at once on either signal (`past_training`). No torch here.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from dtrain.errors import EXIT_INTERRUPTED, EXIT_REQUEUE

# Said by the Trainer too, for a SIGTERM during its set-up (train.stopping).
BEFORE_TRAINING = "stopped by SIGTERM before training began"
NOTHING_TO_SAVE = f"{BEFORE_TRAINING}; nothing to save — rerun the same command to start"
INTERRUPTED_BEFORE_TRAINING = "interrupted (Ctrl-C) before training began"
NOTHING_TO_SAVE_INTERRUPTED = f"{INTERRUPTED_BEFORE_TRAINING}; nothing to save — rerun the same command to start"


def launcher_stopping_mark(launcher_pid: int | str) -> Path:
    """A file dtrain's launcher creates on its own SIGTERM, before torch's agent passes it on to the
    workers: then rank 0 says the line itself (the launcher cannot see the workers' exits)."""
    return Path(tempfile.gettempdir()) / f"dtrain-launcher-{launcher_pid}-stopping"


def _stop(signum: int, frame: object) -> None:
    if signum == signal.SIGINT:  # the launcher answers its own Ctrl-C with 130 and no line: rank 0 says it
        if os.environ.get("RANK", "0") == "0":
            _say(NOTHING_TO_SAVE_INTERRUPTED)
        os._exit(EXIT_INTERRUPTED)
    launcher = os.environ.get("DTRAIN_LAUNCHED")  # distributed.LAUNCHED_BY_DTRAIN: the launcher's pid
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    try:
        if launcher and error_file and not launcher_stopping_mark(launcher).exists():
            # Told by the launcher, as failures are: it says the line once, unless another worker's
            # failure is what stopped the group (torch's agent SIGTERMs the workers left then).
            with open(error_file, "w") as fh:
                json.dump({"message": NOTHING_TO_SAVE, "timestamp": int(time.time())}, fh)
        elif os.environ.get("RANK", "0") == "0":  # said once: by the launcher, or by rank 0
            _say(NOTHING_TO_SAVE)
    except Exception:  # a console or file gone is no reason to stay
        pass
    os._exit(EXIT_REQUEUE)


def _say(line: str) -> None:
    try:
        print(f"dtrain: {line}", file=sys.stderr, flush=True)
    except Exception:  # a console gone is no reason to stay
        pass


def install(interrupt: bool = False) -> None:
    """From now until the Trainer takes over, SIGTERM ends this process with 75 and one line; with
    `interrupt` (a run's launcher or worker, a launched script's worker), Ctrl-C with 130 and one line."""
    signal.signal(signal.SIGTERM, _stop)
    if interrupt:
        signal.signal(signal.SIGINT, _stop)


FINISHED = "as the run ended: it had finished, nothing is lost — the same command says it is complete"


def _after_finishing(signum: int, frame: object) -> None:
    """A signal after a run finished, while its process ends: one line from rank 0, the signal's status."""
    interrupted = signum == signal.SIGINT
    if os.environ.get("RANK", "0") == "0":
        _say(f"{'interrupted (Ctrl-C)' if interrupted else 'stopped by SIGTERM'} {FINISHED}")
    os._exit(EXIT_INTERRUPTED if interrupted else EXIT_REQUEUE)


def _after_stopping(signum: int, frame: object) -> None:
    """A signal after a stop said its line (checkpoint written), while the process ends: end now, quietly."""
    os._exit(EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_REQUEUE)


def past_training(signum: int, finished: bool, stopped: bool) -> object:
    """The handler of `signum` once the Trainer let go of it in a dtrain worker, whose process ends next:
    after a run that `finished` or `stopped` (its line said), a signal ends it at once, never mid-teardown
    with a traceback; after a failure (being reported), the default."""
    if finished:
        return _after_finishing
    if stopped:
        return _after_stopping
    return signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL


def installed(handler: object) -> bool:
    """Whether `handler` (what signal.signal returned) is this module's."""
    return handler is _stop
