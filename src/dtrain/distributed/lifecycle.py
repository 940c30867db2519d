"""A worker's life under its launcher: dying with dtrain's launcher, and leaving without the
interpreter's teardown."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Mapping
from typing import NoReturn

# Set by `dtrain run/launch` for the workers it starts (the value: the launcher's pid). Its workers
# leave reporting errors to it, and die with it.
LAUNCHED_BY_DTRAIN = "DTRAIN_LAUNCHED"


def die_with_the_launcher(environ: Mapping[str, str] = os.environ) -> None:
    """Under dtrain's launcher, have the kernel SIGKILL this worker when the launcher dies (Linux's
    PR_SET_PDEATHSIG): a launcher killed with SIGKILL cannot stop its workers, and they would go on
    training under init, writing checkpoints and holding run.dir's lock. torchrun's agent runs
    inside the launcher, so the launcher is this worker's parent."""
    launcher = environ.get(LAUNCHED_BY_DTRAIN, "")
    if not launcher.isdigit() or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != int(launcher):  # it died before the request was in place
        os._exit(128 + signal.SIGKILL)


def end_worker_process(code: int) -> NoReturn:
    """End this worker process with `code` as a normal exit would (atexit handlers run, output
    flushed), but without the interpreter's teardown.

    torch's DistributedDataParallel keeps its process group, and so gloo's worker threads, alive until
    the process ends, even after destroy_process_group. A gloo thread that drops the last tensor of a
    just-finished collective needs the GIL for it; if the interpreter is tearing down by then, the
    thread is killed holding C++ state and the finished run dies with SIGABRT ("terminate called
    without an active exception") or SIGSEGV — reported as a crash, a few percent of runs on a busy
    machine. Leaving with os._exit after the normal exit work avoids that teardown entirely.
    """
    import atexit
    import logging

    atexit._run_exitfuncs()  # what sys.exit would run (trackers, loggers, temporary files)
    logging.shutdown()
    flush_open_files()
    os._exit(code)


def flush_open_files() -> None:
    """Flush every file object still open in this process, standard streams included.

    The interpreter's teardown finalises open files (closing flushes their buffers), so a script that
    writes a file and never closes it finds it whole under `python` and torchrun. os._exit skips that,
    and the buffered tail would be lost: flushing them all here keeps what a normal exit keeps. Not
    closed: a library's atexit handler or a daemon thread may still hold one."""
    import gc
    import io

    for obj in gc.get_objects():
        # By its type: isinstance would read `__class__` of every object, and some (deprecated torch
        # aliases) warn when read.
        if issubclass(type(obj), io.IOBase):
            with contextlib.suppress(Exception):
                if not obj.closed and obj.writable():
                    obj.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
