"""What the commands share: their parser (a usage mistake in one line), the launch flags passed to torchrun,
the notes a config's loading made, and SIGTERM while a command writes a folder."""

from __future__ import annotations

import argparse
import sys

from dtrain.errors import EXIT_REQUEUE, DtrainError
from dtrain.placement import in_worker_environment, is_torchrun_worker

LAUNCH_FLAGS = (
    "nproc",
    "nnodes",
    "node_rank",
    "rdzv_endpoint",
    "rdzv_id",
    "rdzv_timeout",
    "rdzv_last_call",
    "max_restarts",
    "local_addr",
)


class Parser(argparse.ArgumentParser):
    """argparse, with a usage mistake said in one line (exit 2) like every other bad input."""

    def error(self, message: str):
        raise DtrainError(f"{self.prog}: {message} (see {self.prog} --help)")


def add_launch_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("launch (passed to torchrun)")
    g.add_argument(
        "--nproc", type=int, default=None, metavar="N", help="worker processes on this node (one per GPU; default 1)"
    )
    g.add_argument("--nnodes", default=None, metavar="N|MIN:MAX", help="nodes in the job (default 1)")
    g.add_argument(
        "--node-rank",
        type=int,
        default=None,
        metavar="R",
        help="this node's fixed rank (static rendezvous); omit for elastic c10d rendezvous",
    )
    g.add_argument(
        "--rdzv-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="rendezvous address on the first node, reachable from every node",
    )
    g.add_argument("--rdzv-id", default=None, metavar="ID", help="job id shared by all nodes (default dtrain)")
    g.add_argument(
        "--rdzv-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long a node waits for the rendezvous and the other nodes (default 600)",
    )
    g.add_argument(
        "--rdzv-last-call",
        type=int,
        default=None,
        metavar="SECONDS",
        help="elastic jobs (--nnodes MIN:MAX): once MIN nodes are in, how long the group waits for more "
        "before it starts or restarts (default 30, torchrun's)",
    )
    g.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        metavar="R",
        help="restart the whole group up to R times when a worker fails (default 0); "
        "restarts resume from the newest checkpoint",
    )
    g.add_argument(
        "--local-addr",
        default=None,
        metavar="ADDR",
        help="this node's address as the other nodes reach it (default: worked out from the route to --rdzv-endpoint)",
    )


def launch_spec(args: argparse.Namespace):
    from dtrain.launch import LaunchSpec

    spec = LaunchSpec()
    for name in LAUNCH_FLAGS:
        value = getattr(args, name)
        if value is not None:
            setattr(spec, name, value)
    return spec


def explicit_launch(args: argparse.Namespace) -> bool:
    return any(getattr(args, name) is not None for name in LAUNCH_FLAGS)


def say_notes(notes: list[str]) -> None:
    """What loading the config noted (a renamed key, settings that do nothing), said once per job: by the
    launcher, or by rank 0 where something else started every worker; never by torchrun's workers, which
    load it again."""
    if not notes or is_torchrun_worker():
        return
    from dtrain.placement import detect_env

    if in_worker_environment() and detect_env().rank != 0:
        return
    for note in notes:
        print(f"note: {note}", file=sys.stderr)


class Stopped:
    """SIGTERM while a command writes `out` (prepare, export): unwind (exit 75, one line), so that nothing
    of `out` is left behind. The early handler would end the process at once (os._exit), leaving the
    staging folder beside `out`. Raised where the signal lands, the error may come back wrapped (DCP wraps
    what its read raises): `fired` tells the command to say this line all the same."""

    def __init__(self, out: str, what: str):
        self.error = DtrainError(f"stopped by SIGTERM; nothing was written to {out} — rerun the same command to {what}")
        self.error.exit_code = EXIT_REQUEUE
        self.fired = False

    def __call__(self, signum: int, frame: object) -> None:
        self.fired = True
        raise self.error
