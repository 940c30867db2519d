"""Errors meant for people: one line that names the key or file and says what would work."""

from __future__ import annotations

# Exit status of a run refused for bad input (config, data path, backend, sizes). Crashes exit 1.
EXIT_USAGE = 2


class DtrainError(Exception):
    """A problem the user can fix. Its message is printed as one line, once, and the run exits 2.

    One line whatever it quotes: a value, key or file name holding a newline or another control
    character is shown escaped (`\\n`), never breaking the line."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str = ""):
        super().__init__("".join(c if c.isprintable() else repr(c)[1:-1] for c in str(message)))


class ConfigError(DtrainError):
    """A config key, type or value that cannot work."""


class DataError(DtrainError):
    """A data set that is missing, malformed or too small for the job."""


class EnvironmentProblem(DtrainError):
    """Something this machine or the distributed environment cannot provide (GPUs, backend, addresses)."""


class PeersMissing(EnvironmentProblem):
    """The job's other ranks did not come within distributed.timeout_s: a pod, srun or mpirun task
    started while the others never were, or cannot be reached."""


class Rank0Missing(PeersMissing):
    """Rank 0 never answered: no rank 0 is there to say it, so the rank that waited for it does."""


# Exit status of a run stopped by SIGTERM after writing its checkpoint: EX_TEMPFAIL from sysexits.h,
# "temporary failure, try again" — what a scheduler's requeue rule should match.
EXIT_REQUEUE = 75


class Preempted(Exception):
    """The run stopped on SIGTERM after writing a checkpoint; rerunning the same command resumes."""

    exit_code = EXIT_REQUEUE


# Exit status of a run stopped by Ctrl-C (SIGINT): 128 + 2, the shell's convention for an interrupt.
EXIT_INTERRUPTED = 130


class Interrupted(Preempted):
    """The run stopped on Ctrl-C (SIGINT) after writing a checkpoint; rerunning the same command resumes.
    Not a requeue: a person stopped it."""

    exit_code = EXIT_INTERRUPTED


# Exit status of a run that stopped because another run took its run.dir over (the lease on an object store
# lost: see rundir/lease.py): EX_CANTCREAT from sysexits.h, "cannot create output". Not 75: requeued, the
# run would only be refused (or fight the new holder); not 2: no input of the user's was wrong.
EXIT_RUN_DIR_LOST = 73


class RunDirLost(DtrainError):
    """Rank 0 lost run.dir's lease while the run lived: the group stopped at a step boundary, every rank
    together, and wrote nothing more to the store (another run owns it now). Lost after the last step,
    rank 0 says so as the run ends: its last outputs are only in the staging folder."""

    exit_code = EXIT_RUN_DIR_LOST


# Exit status of a run the hang watchdog ended (as `timeout` reports it).
EXIT_HANG = 124
