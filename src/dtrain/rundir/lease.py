"""One live run per run.dir on an object store: a lease object, `<run.dir>/.lease`.

A store has no flock that dies with its holder, so the lock there is a lease: a small JSON object naming
its holder (host, pid, run) and an expiry, taken with a conditional PUT (S3's If-None-Match: of two runs
starting together exactly one gets it), renewed from a thread every third of its term (If-Match on the
ETag it last wrote: a renewal never overwrites a lease someone else took), deleted at release. A holder
that died (kill -9, a lost node) stops renewing; once its lease has expired the next run takes it over
(If-Match again, so two runs taking over the same dead lease cannot both win) and says so in one line.
A live run that loses its lease — a renewal finding it taken over, or renewals failing for longer than
its term — sends nothing more to the store and stops at its next step boundary (exit 73, RunDirLost).
Locally the flock in rundir/lock.py stays (no store, no clock).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable

from dtrain import objstore
from dtrain.errors import DtrainError

NAME = ".lease"
# How long a lease outlives its last renewal: a dead run's run.dir is free a minute later. The tests shorten
# it (DTRAIN_LEASE_TERM_S) to see a lease lost while a run trains without waiting minutes.
TERM_S = float(os.environ.get("DTRAIN_LEASE_TERM_S") or 60.0)


class RunDirLease:
    """The lease on `<url>/.lease`, held by rank 0 for the life of the run."""

    def __init__(
        self,
        url: str,
        run: str = "",
        term_s: float = TERM_S,
        say: Callable[[str], None] | None = None,
        every_renewal: Callable[[], None] | None = None,
        on_lost: Callable[[str], None] | None = None,
    ):
        self.url, self.run, self.term_s = objstore.join(url, NAME), run, term_s
        self.every_renewal = every_renewal  # also done from the renewing thread (the run's outputs sent)
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.took_over = ""  # the line saying whose expired lease acquire() took over, if it did
        self.lost = False  # set when a renewal found the lease taken by another run, or failed past its term
        self.lost_line = ""  # the line saying so
        # Told (instead of `say`) the line saying so: the run then stops writing (train.stopping, RunDirLost).
        self.on_lost = on_lost
        self._renewed = time.monotonic()  # when the store last took this run's lease
        self._etag: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self._etag is not None and not self.lost

    def acquire(self) -> None:
        """Take the lease, or refuse in one line naming the live holder; start renewing it."""
        try:
            self._etag = objstore.write_bytes(self.url, self._body(), "run.dir", if_absent=True)
        except objstore.Conflict:
            self._take_over()
        self._stop.clear()
        self._renewed = time.monotonic()
        self._thread = threading.Thread(target=self._renew_until_stopped, name="dtrain-lease", daemon=True)
        self._thread.start()

    def check_free(self) -> None:
        """Refuse now if a live run holds the lease (without taking it or writing anything)."""
        held = self._read()
        if held is not None and not _expired(held[0]):
            raise self._in_use(held[0])

    def release(self) -> None:
        """Stop renewing and delete the lease, if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._etag is None or self.lost:
            return
        held = self._read()
        if held is not None and held[1] == self._etag:
            objstore.remove([self.url], "run.dir")
        self._etag = None

    def renew(self) -> None:
        """Push the expiry a term ahead, only if the lease is still the one this run last wrote."""
        if self._etag is None or self.lost:
            return
        try:
            self._etag = objstore.write_bytes(self.url, self._body(), "run.dir", if_etag=self._etag)
            self._renewed = time.monotonic()
        except objstore.Conflict:
            held = self._read()
            holder = _holder(held[0]) if held else "nobody holds it now"
            self._lose(f"another run took its lease over ({holder}) after this run failed to renew it in time")

    def _lose(self, what: str) -> None:
        """The lease is no longer this run's: nothing more is sent (see rundir.claim) and the run stops."""
        self.lost = True
        line = self.lost_line = f"run.dir {self.url.rsplit('/', 1)[0]}: {what}"
        if self.on_lost is not None:
            self.on_lost(line)
        else:
            self.say(f"dtrain: {line}; this run sends nothing more there")

    def _renew_until_stopped(self) -> None:
        while not self._stop.wait(self.term_s / 3):
            try:
                self.renew()
                if self.every_renewal is not None and not self.lost:
                    self.every_renewal()
            except (objstore.StorageError, OSError) as exc:  # the store did not answer this time: the next may
                failing = time.monotonic() - self._renewed
                if failing > self.term_s and not self.lost:  # expired by now: another run may hold it
                    self._lose(
                        f"its lease could not be renewed for {failing:.0f} s, longer than its {self.term_s:g} s term "
                        f"(last: {exc}), so another run may own run.dir now"
                    )
                else:
                    self.say(f"dtrain: could not renew the lease on run.dir or send its outputs ({exc}); trying again")
            if self.lost:
                return

    def _take_over(self) -> None:
        held = self._read()
        if held is None:  # released between our PUT and this read: try once more as a fresh taker
            try:
                self._etag = objstore.write_bytes(self.url, self._body(), "run.dir", if_absent=True)
                return
            except objstore.Conflict:
                held = self._read()
        if held is None:
            raise DtrainError(f"run.dir {self.url}: the lease changes hands as we look; try again")
        info, etag = held
        if not _expired(info):
            raise self._in_use(info)
        try:
            self._etag = objstore.write_bytes(self.url, self._body(), "run.dir", if_etag=etag)
        except objstore.Conflict:  # another run took the expired lease first
            fresh = self._read()
            raise self._in_use(fresh[0] if fresh else info) from None
        self.took_over = (
            f"took over the lease on run.dir from {_holder(info)}: it expired at {_when(info['expires'])} "
            f"without being renewed (that run died, or lost the store)"
        )

    def _read(self) -> tuple[dict, str] | None:
        try:
            data, etag = objstore.read_bytes(self.url, "run.dir")
        except FileNotFoundError:
            return None
        try:
            info = json.loads(data)
            float(info["expires"])
        except (ValueError, KeyError, TypeError):
            raise DtrainError(
                f"{self.url} is where dtrain keeps run.dir's lease, and it is not one dtrain wrote (a file of "
                f"yours?); move it, or choose another run.dir"
            ) from None
        return info, etag

    def _body(self) -> bytes:
        now = time.time()
        return json.dumps(
            {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "run": self.run,
                "since": _when(now),
                "expires": now + self.term_s,
            }
        ).encode()

    def _in_use(self, info: dict) -> DtrainError:
        return DtrainError(
            f"run.dir {self.url.rsplit('/', 1)[0]} is in use by another run ({_holder(info)}; its lease runs "
            f"to {_when(info['expires'])} and is renewed while it lives); wait for it to finish or choose "
            f"another run.dir"
        )


def _expired(info: dict) -> bool:
    return float(info["expires"]) < time.time()


def _holder(info: dict) -> str:
    run = f", run {info['run']}" if info.get("run") else ""
    return f"pid {info.get('pid', '?')} on {info.get('host', '?')}{run}, since {info.get('since', '?')}"


def _when(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(epoch)))
