"""A wait said out loud: what this process waits for, a moment after the wait began and then at a slow,
fixed pace, until it ends. Without it a node waiting for its peers, its endpoint or rank 0 looks hung.
Also the waits themselves that every entry point shares: for an endpoint to answer, and for rank 0."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from dtrain.errors import ConfigError, EnvironmentProblem, Rank0Missing

if TYPE_CHECKING:
    from dtrain.placement import DistEnv

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


class EndpointWait:
    """Waiting for the rendezvous endpoint until a deadline: said after a moment and then at a slow
    pace (`WaitReport`), given up in one line (an `error`). `server` is who serves the endpoint; `knob`
    what sets the wait, `knobs` what sets the address and the wait."""

    def __init__(
        self,
        endpoint: str,
        timeout: float,
        server: str = "the first node",
        knob: str = "--rdzv-timeout",
        knobs: str = "--rdzv-timeout sets the wait",
        error: type[EnvironmentProblem] = EnvironmentProblem,
    ):
        self.endpoint, self.timeout, self.server, self.knob, self.knobs = endpoint, timeout, server, knob, knobs
        self.error = error
        self.deadline = time.monotonic() + timeout
        self.reason = ""
        self._report = WaitReport(self._line)

    def _line(self) -> str:
        left = self.deadline - time.monotonic()
        if left < 1:  # the give-up line is due
            return ""
        return (
            f"waiting for the rendezvous at {self.endpoint} ({self.server} serves it; {self.reason}), "
            f"giving up in {left:.0f} s ({self.knob})"
        )

    def again(self, reason: str) -> None:
        """Note why the wait goes on and sleep a little; or give up, past the deadline."""
        self.reason = reason
        if time.monotonic() >= self.deadline:
            self.over()
            start = "the job on the node" if self.server == "the first node" else self.server
            raise self.error(
                f"nothing answered at {self.endpoint} for {self.timeout:g} s ({reason}): start "
                f"{start} at that address, or check the address, the port and the firewall "
                f"({self.knobs})"
            )
        self._report.start()
        time.sleep(min(1.0, max(0.0, self.deadline - time.monotonic())))

    def over(self) -> None:
        self._report.stop()


def wait_for_endpoint(wait: EndpointWait) -> None:
    """Wait until something listens at the rendezvous endpoint (the first node's store). Left to torch,
    an endpoint that is not up yet fills the screen with C++ stack traces and ends in an exception a
    minute or more later."""
    host, _, port = wait.endpoint.rpartition(":")
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(5.0, wait.timeout)):
                return
        except OSError as exc:
            wait.again(exc.strerror or type(exc).__name__)


def wait_for_rank0(env: DistEnv, timeout: float) -> None:
    """A rank other than 0 waits, visibly, until rank 0's store at MASTER_ADDR:MASTER_PORT answers, and
    gives up in one line (`Rank0Missing`) after `timeout` seconds. Started together (torchrun, srun) it
    answers within a second; a pod's rank 0 may start minutes later, or never."""
    if env.world_size > 1 and env.rank != 0:
        wait = EndpointWait(
            f"{env.master_addr}:{env.master_port}",
            timeout,
            server="rank 0",
            knob="distributed.timeout_s",
            knobs="MASTER_ADDR and MASTER_PORT set the address, distributed.timeout_s the wait",
            error=Rank0Missing,
        )
        try:
            wait_for_endpoint(wait)
        finally:
            wait.over()
