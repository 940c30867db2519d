"""Faults at a chosen moment of a real process, for tests; on PYTHONPATH, off unless asked:

SIGTERM_AT_IMPORT=MODULE[@WHERE]: the process sends itself SIGTERM when it first imports MODULE, as a
scheduler's signal would land while torch is importing (WHERE: `launcher`, `worker` or `rank0`; any
process if omitted). With SIGTERM_AT_IMPORT_TO=parent the signal goes to the parent instead (a
worker's: the launcher); SIGTERM_AT_IMPORT_SIGNAL=SIGINT sends Ctrl-C's signal instead.

SLOW_FSYNC=TEXT:SECONDS: a slow disk for the files whose path contains TEXT — each fsync of one takes
SECONDS longer, and its path is appended to SLOW_FSYNC_NOTE (a file) when it starts, so a test knows
that such a write is under way.

KILL_AT_STORE_SEAL=STEP:before|after: rank 0 SIGKILLs itself when it seals checkpoint STEP on an object
store (checkpoint/remote.py's `seal`: the PUT of COMPLETE.json) — just before that PUT, or just after it
(before any local folder is sealed), the moments between which a checkpoint comes to exist.
"""

import os
import signal
import sys

_worker = "TORCHELASTIC_RUN_ID" in os.environ
_WHERE = {
    "": True,
    "launcher": not _worker,
    "worker": _worker,
    "rank0": _worker and os.environ.get("RANK") == "0",
}

_module, _, _where = os.environ.get("SIGTERM_AT_IMPORT", "").partition("@")


class _SigtermOnImport:
    def find_spec(self, name, path=None, target=None):
        if name == _module:
            sys.meta_path.remove(self)
            to_parent = os.environ.get("SIGTERM_AT_IMPORT_TO") == "parent"
            signum = getattr(signal, os.environ.get("SIGTERM_AT_IMPORT_SIGNAL", "SIGTERM"))
            os.kill(os.getppid() if to_parent else os.getpid(), signum)  # handled inside the import
        return None  # the import itself goes on as usual


if _module and _WHERE.get(_where, False):
    sys.meta_path.insert(0, _SigtermOnImport())

_slow, _, _seconds = os.environ.get("SLOW_FSYNC", "").rpartition(":")
if _slow and _worker:
    import time

    _fsync = os.fsync

    def _slow_fsync(fd):
        try:
            path = os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}")
        except OSError:
            path = ""
        if _slow in path:
            with open(os.environ["SLOW_FSYNC_NOTE"], "a") as note:
                note.write(path + "\n")
            time.sleep(float(_seconds))
        return _fsync(fd)

    os.fsync = _slow_fsync

_seal_step, _, _seal_when = os.environ.get("KILL_AT_STORE_SEAL", "").partition(":")
if _seal_step and _worker and os.environ.get("RANK") == "0":
    from dtrain.checkpoint import remote as _remote

    _seal = _remote.RemoteCheckpointStore.seal

    def _seal_then_maybe_die(self, step, marker):
        if step == int(_seal_step) and _seal_when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        _seal(self, step, marker)
        if step == int(_seal_step) and _seal_when == "after":
            os.kill(os.getpid(), signal.SIGKILL)

    _remote.RemoteCheckpointStore.seal = _seal_then_maybe_die
