"""A wait said out loud: what this process waits for, a moment after the wait began and then at a slow,
fixed pace, until it ends. Without it a node waiting for its peers, its endpoint or rank 0 looks hung."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable

from dtrain.errors import ConfigError

FIRST_LINE_S = 2.0  # a wait shorter than this says nothing
REPORT_S = 30.0  # seconds between two lines of one wait
REPORT_VARIABLE = "DTRAIN_WAIT_REPORT_S"  # overrides REPORT_S (tests wait seconds, not minutes)


def report_every() -> float:
    value = os.environ.get(REPORT_VARIABLE, "")
    if not value:
        return REPORT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not 0.1 <= seconds <= 86_400:  # also refuses nan
        raise ConfigError(f"{REPORT_VARIABLE} must be a number of seconds from 0.1 to 86400; got '{value}'")
    return seconds


class WaitReport:
    """Print `line()` after `first_s`, then every `report_every()` seconds, from a daemon thread, so a
    wait stuck in C++ (a store, a rendezvous) is said as well. `line` returns the text to say, "" for
    nothing this time, or None when the wait is over. Nothing is printed once `stop()` returned, so the
    caller's last word (a give-up line) stays last."""

    def __init__(self, line: Callable[[], str | None], first_s: float = FIRST_LINE_S):
        self._line, self._first_s, self._every_s = line, first_s, report_every()
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> WaitReport:
        if self._thread is None and not self._stopped.is_set():
            self._thread = threading.Thread(target=self._say, name="dtrain-wait-report", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        with self._lock:  # a line being printed is finished first; none comes after
            self._stopped.set()

    def __enter__(self) -> WaitReport:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _say(self) -> None:
        pause = self._first_s
        while not self._stopped.wait(pause):
            try:
                text = self._line()
            except Exception:  # a report must never end the wait it reports
                text = ""
            if text is None:
                return
            with self._lock:
                if self._stopped.is_set():
                    return
                if text:
                    print(f"dtrain: {text}", file=sys.stderr, flush=True)
            pause = self._every_s
