"""The launcher's signals: the elastic agent acts on the first SIGTERM or Ctrl-C only (a second Ctrl-C
reaches the workers), and Ctrl-C or SIGTERM end a node still joining the rendezvous inside a C++ wait."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from dtrain import early_stop
from dtrain.errors import EXIT_INTERRUPTED, EXIT_REQUEUE

if TYPE_CHECKING:
    from types import FrameType


def signals_once() -> None:
    """Have the elastic agent act on the first SIGTERM or Ctrl-C only. Its handler raises SignalException
    on every one; the first starts the shutdown (the signal passed on to the workers,
    `checkpoint.preempt_grace_s` for their checkpoint, then SIGKILL), and a repeat during that wait — a
    scheduler saying it again, an impatient user — would abort it: the launcher would exit and its
    workers die with it (`die_with_the_launcher`), mid-checkpoint, without a word. A repeated SIGTERM is
    dropped; a second Ctrl-C is passed on to the workers, which then stop at once and say what a rerun
    will do (train.stopping). torch installs the handler by this module-level name when it starts the
    workers."""
    from torch.distributed.elastic.multiprocessing import api

    raise_signal = api._terminate_process_handler
    if getattr(raise_signal, "dtrain_once", False):
        return
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        if stopping:  # the workers were told; the grace runs from the first
            if signum == signal.SIGINT:
                _interrupt_workers()
            return
        stopping = True
        if signum == signal.SIGTERM:
            _mark_stopping()
        raise_signal(signum, frame)

    on_signal.dtrain_once = True  # type: ignore[attr-defined]
    api._terminate_process_handler = on_signal


def _interrupt_workers() -> None:
    """Ctrl-C to this launcher's workers (its children that torchrun gave a LOCAL_RANK): they run in
    sessions of their own, out of reach of the terminal's."""
    for pid, environ in children(os.getpid()):
        if any(var.startswith(b"LOCAL_RANK=") for var in environ):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGINT)


def children(parent: int) -> Iterator[tuple[int, list[bytes]]]:
    """(pid, environment as NAME=value entries) of each living child process of `parent` (Linux's /proc)."""
    for entry in os.scandir("/proc"):
        try:
            with open(f"/proc/{entry.name}/stat") as stat:  # "PID (COMM) STATE PPID ..."
                if stat.read().rpartition(")")[2].split()[1] != str(parent):
                    continue
            with open(f"/proc/{entry.name}/environ", "rb") as environ:
                yield int(entry.name), environ.read().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # not a process, or gone meanwhile


def _mark_stopping() -> None:
    """Tell this launcher's workers that the SIGTERM they are about to get is a preemption (see
    early_stop.launcher_stopping_mark); the mark goes when the launcher does."""
    import atexit

    mark = early_stop.launcher_stopping_mark(os.getpid())
    with contextlib.suppress(OSError):
        mark.touch()
        atexit.register(lambda: mark.unlink(missing_ok=True))


def signals_reach_a_joining_node(patience_s: float = 1.0) -> None:
    """Ctrl-C and SIGTERM end a node that is still joining. torch's static rendezvous (--node-rank)
    waits for the other nodes inside one C++ call (the TCPStore's constructor), where Python's signal
    handlers never run: the signal did nothing until the rendezvous timed out, minutes later. A thread
    woken by every signal (the interpreter writes its number to `set_wakeup_fd`) ends the process when
    the main thread has not, within `patience_s`, and no worker was started yet (torch's own handler,
    installed as it starts them, then handles the signal). Nothing is written before workers start."""
    if threading.current_thread() is not threading.main_thread():
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    try:
        signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    except ValueError:
        return
    from torch.distributed.elastic.multiprocessing import api

    def watch() -> None:
        while True:
            signum = os.read(read_end, 1)[0]
            if signum not in (signal.SIGINT, signal.SIGTERM):
                continue
            time.sleep(patience_s)
            if signal.getsignal(signum) is api._terminate_process_handler:
                continue  # workers exist: the agent stops them
            line = early_stop.NOTHING_TO_SAVE if signum == signal.SIGTERM else early_stop.NOTHING_TO_SAVE_INTERRUPTED
            with contextlib.suppress(Exception):
                print(f"dtrain: {line}", file=sys.stderr, flush=True)
            os._exit(EXIT_REQUEUE if signum == signal.SIGTERM else EXIT_INTERRUPTED)

    threading.Thread(target=watch, name="dtrain-signals-while-joining", daemon=True).start()
