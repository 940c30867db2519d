"""SIGTERM (a scheduler preempting the job) asks the run to stop at the next point the ranks agree on.

The handler only sets a flag: the step in flight finishes, the ranks agree at the next logging
all-reduce (every `training.log_every` steps, sooner where steps are slow: Trainer._pace_stop_checks;
every step in a one-process run), write one checkpoint and exit with EXIT_REQUEUE.
"""

from __future__ import annotations

import signal
import threading


class StopRequest:
    def __init__(self):
        self.requested = False
        self._previous = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _handle(self, signum, frame) -> None:
        self.requested = True
