"""Start workers through torch's own elastic launcher (torchrun), in this process.

dtrain never forks or watches workers itself: it turns its flags into torchrun's, gives the workers a
sensible thread count, runs the elastic agent, and turns a failed group into one clear report.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dtrain import distributed
from dtrain.distributed import netaddr
from dtrain.distributed.waiting import EndpointWait, wait_for_endpoint
from dtrain.errors import EXIT_HANG, EXIT_REQUEUE, EXIT_RUN_DIR_LOST, EXIT_USAGE, ConfigError

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

MAX_RDZV_TIMEOUT = 10_000_000  # seconds: about four months


@dataclass
class LaunchSpec:
    nproc: int = 1
    nnodes: str = "1"  # "N" or "MIN:MAX" (elastic)
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str = "dtrain"
    max_restarts: int = 0
    local_addr: str | None = None  # this node's address as the other nodes reach it
    shutdown_grace_s: float = 120.0  # after SIGTERM, before torchrun kills the workers
    rdzv_timeout: float = 600.0  # seconds a node waits for the others (torchrun's join timeout)
    # Elastic (--nnodes MIN:MAX): once MIN nodes are in, seconds the rendezvous waits for more before the
    # group starts (torchrun's last_call_timeout; None: its own 30 s), at every (re)start.
    rdzv_last_call: int | None = None

    @property
    def min_nodes(self) -> int:
        return int(self.nnodes.split(":")[0])

    @property
    def max_nodes(self) -> int:
        return int(self.nnodes.split(":")[-1])

    @property
    def multi_node(self) -> bool:
        return self.nnodes != "1"

    def validate(self) -> None:
        if self.nproc < 1:
            raise ConfigError(f"--nproc must be >= 1; got {self.nproc}")
        parts = self.nnodes.split(":")
        if (
            not all(p.isdigit() and int(p) >= 1 for p in parts)
            or len(parts) > 2
            or (len(parts) == 2 and int(parts[0]) > int(parts[1]))
        ):
            raise ConfigError(f"--nnodes must be a node count N or a range MIN:MAX; got '{self.nnodes}'")
        if not 1 <= self.rdzv_timeout <= MAX_RDZV_TIMEOUT:  # torchrun takes whole seconds, at least 1
            raise ConfigError(
                f"--rdzv-timeout must be from 1 to {MAX_RDZV_TIMEOUT:,} seconds; got {self.rdzv_timeout:g}"
            )
        if self.rdzv_last_call is not None:
            if self.min_nodes == self.max_nodes or self.node_rank is not None:
                raise ConfigError(
                    "--rdzv-last-call is for an elastic job (--nnodes MIN:MAX, no --node-rank): "
                    f"with --nnodes {self.nnodes}"
                    + (" and --node-rank" if self.node_rank is not None else "")
                    + " the group never waits for more nodes; leave it out"
                )
            if not 1 <= self.rdzv_last_call <= self.rdzv_timeout:
                raise ConfigError(
                    f"--rdzv-last-call must be from 1 to --rdzv-timeout ({self.rdzv_timeout:g}) seconds; "
                    f"got {self.rdzv_last_call}"
                )
        if not 0 <= self.max_restarts <= 10_000:
            raise ConfigError(f"--max-restarts must be from 0 to 10000; got {self.max_restarts}")
        if self.nproc > 4096:  # processes per node: no machine runs more
            raise ConfigError(f"--nproc must be at most 4096; got {self.nproc}")
        if self.multi_node and not self.rdzv_endpoint:
            raise ConfigError(
                "--nnodes > 1 needs --rdzv-endpoint HOST:PORT (an address of the first node that every node can reach)"
            )
        if self.rdzv_endpoint and not _is_host_port(self.rdzv_endpoint):
            raise ConfigError(f"--rdzv-endpoint must be HOST:PORT; got '{self.rdzv_endpoint}'")
        if self.node_rank is not None and not 0 <= self.node_rank < self.min_nodes:
            raise ConfigError(f"--node-rank must be in 0..{self.min_nodes - 1}; got {self.node_rank}")
        slurm_nodes = os.environ.get("SLURM_NNODES", "")
        if slurm_nodes.isdigit() and self.min_nodes > int(slurm_nodes):
            # The missing nodes can never come: the rendezvous would wait --rdzv-timeout for nothing.
            raise ConfigError(
                f"--nnodes {self.nnodes} needs {self.min_nodes} nodes and this SLURM job has "
                f"SLURM_NNODES={slurm_nodes}: use --nnodes {slurm_nodes} or fewer, or ask SLURM for more nodes"
            )


def _is_host_port(value: str) -> bool:
    host, sep, port = value.rpartition(":")
    return bool(sep and host and port.isdigit())


def _torchrun_knows(option: str) -> bool:
    """Whether this torch's torchrun takes `option` (a GPU image's torch can be older than the floor)."""
    from torch.distributed.run import get_args_parser

    _, unknown = get_args_parser().parse_known_args([f"{option}=1", "entry.py"])
    return not unknown


def torchrun_args(
    spec: LaunchSpec, entry: list[str], local_addr: str | None = None, is_host: bool = False
) -> list[str]:
    """The torchrun command line (without 'torchrun') for `spec`, running `entry` in each worker."""
    args = [f"--nproc-per-node={spec.nproc}", f"--max-restarts={spec.max_restarts}"]
    if _torchrun_knows("--shutdown-timeout"):  # torch 2.13 on; older torchrun waits its own 30 s
        args.append(f"--shutdown-timeout={int(spec.shutdown_grace_s)}")
    if not spec.rdzv_endpoint:  # one node (validate() refuses several without an endpoint)
        return args + ["--standalone"] + entry  # a private rendezvous on a free local port
    host, _, port = spec.rdzv_endpoint.rpartition(":")
    if spec.node_rank is not None:
        args += [
            f"--nnodes={spec.nnodes}",
            "--rdzv-backend=static",
            f"--node-rank={spec.node_rank}",
            f"--master-addr={host}",
            f"--master-port={port}",
            f"--rdzv-conf=timeout={int(spec.rdzv_timeout)}",  # node 0's store waits this long for the others
        ]
    else:
        args += [
            f"--nnodes={spec.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={spec.rdzv_endpoint}",
            f"--rdzv-id={spec.rdzv_id}",
        ]
        # is_host: this node serves the store at the endpoint.
        conf = f"join_timeout={int(spec.rdzv_timeout)}" + (",is_host=1" if is_host else "")
        if spec.rdzv_last_call is not None:
            conf += f",last_call_timeout={spec.rdzv_last_call}"
        args.append(f"--rdzv-conf={conf}")
    if local_addr:
        args.append(f"--local-addr={local_addr}")
    return args + entry


from dtrain.launch.signals import signals_once, signals_reach_a_joining_node  # noqa: E402
from dtrain.launch.waits import own_address, peers_report  # noqa: E402

__all__ = ["LaunchSpec", "launch", "torchrun_args"]


def launch(spec: LaunchSpec, entry: list[str]) -> int:
    """Run `entry` in `spec.nproc` workers per node under torchrun; the job's exit status."""
    from torch.distributed import DistStoreError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousTimeoutError
    from torch.distributed.run import get_args_parser, run

    spec.validate()
    if "OMP_NUM_THREADS" not in os.environ:
        # torchrun would set 1; split the cores among the local workers instead.
        os.environ["OMP_NUM_THREADS"] = str(max(1, distributed.available_cores() // spec.nproc))
    os.environ[distributed.LAUNCHED_BY_DTRAIN] = str(os.getpid())  # the workers' parent: see die_with_the_launcher
    # Give each restarted group a fresh rendezvous store: when the workers share the agent's store, a
    # restart can read the previous attempt's addresses and hang or fail to connect (torch #135712).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    wait = EndpointWait(spec.rdzv_endpoint, spec.rdzv_timeout) if spec.rdzv_endpoint else None
    try:
        local_addr, is_host = own_address(spec, wait)
        if local_addr and "GLOO_SOCKET_IFNAME" not in os.environ:
            interface = netaddr.interface_of(local_addr)
            if interface:  # gloo would otherwise bind whatever the hostname resolves to
                os.environ["GLOO_SOCKET_IFNAME"] = interface
        serves_endpoint = is_host if spec.node_rank is None else spec.node_rank == 0
        if wait and not serves_endpoint:
            wait_for_endpoint(wait)
    finally:
        if wait:
            wait.over()
    _quiet_elastic_logs()
    signals_once()
    signals_reach_a_joining_node()
    args = get_args_parser().parse_args(torchrun_args(spec, entry, local_addr, is_host))
    try:
        with peers_report(spec):  # over before any line below: the give-up line comes last
            run(args)
        return 0
    except ChildFailedError as exc:
        return _print_first_failure(exc)
    except SignalException as exc:
        # The workers got the signal too; they wrote a checkpoint and rank 0 said so (SIGTERM: 75, Ctrl-C: 130).
        return EXIT_REQUEUE if exc.sigval == signal.SIGTERM else 128 + int(exc.sigval)
    except (RendezvousTimeoutError, DistStoreError):  # DistStoreError: the static store's own wait
        print(
            f"dtrain: error: not enough nodes joined the rendezvous at {spec.rdzv_endpoint} within "
            f"{spec.rdzv_timeout:g} s (--nnodes {spec.nnodes}): start the job on the other nodes with the same "
            f"--rdzv-endpoint, or raise --rdzv-timeout",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_USAGE
    except RendezvousError as exc:
        print(
            f"dtrain: error: the nodes could not form a group ({type(exc).__name__}: {exc}); check "
            f"that --rdzv-endpoint is reachable from every node and --nnodes matches",
            file=sys.stderr,
            flush=True,
        )
        return 1


def _print_first_failure(exc: ChildFailedError) -> int:
    """Print the first failure once; its exit status is the job's. A line dtrain's workers wrote for
    people (bad input, a hang, a SIGTERM before training) is printed as it is, wherever it came among the
    failures: it says why the others stopped; a SIGTERM's line only when no worker failed on its own (else
    torch's agent sent it, because of that failure). Otherwise the first failure decides: a worker's own exit
    status is the job's (a script's `sys.exit(3)` is 3, its 75 a requeue for the scheduler), printed with
    its rank, and a crash's traceback with it; a worker killed by a signal is 1."""
    # A worker that failed on its own (a positive status other than 75) is the cause; a requeue beside it
    # is a worker torchrun stopped because of it, which may come first within the same second.
    own = [(r, f) for r, f in exc.failures.items() if f.exitcode > 0 and f.exitcode != EXIT_REQUEUE]
    said = next(
        (
            f
            for f in exc.failures.values()
            if f.exitcode in SAID_AS_IT_IS and _written_by_worker(f) and not (f.exitcode == EXIT_REQUEUE and own)
        ),
        None,
    )
    if said is not None:
        kind = "" if said.exitcode == EXIT_REQUEUE else "error: "  # a requeue is no error
        print(f"dtrain: {kind}{said.message}", file=sys.stderr, flush=True)
        return said.exitcode
    # torch's first: the earliest, and among failures of the same second the first it saw (the workers
    # it stopped because of it come after).
    rank, failure = exc.get_first_failure()
    if failure.exitcode == EXIT_REQUEUE and own:
        rank, failure = min(own, key=lambda item: (item[1].timestamp, item[0]))
    if failure.exitcode == EXIT_REQUEUE:  # after training began, rank 0 said where its checkpoint is
        return EXIT_REQUEUE
    if failure.exitcode < 0:
        what = f"was killed by {failure.signal_name()}"
    else:
        what = f"exited with status {failure.exitcode}"
    detail = failure.message if _written_by_worker(failure) else ""
    print(
        f"dtrain: error: rank {rank} (local rank {failure.local_rank}) {what}" + (f":\n{detail}" if detail else ""),
        file=sys.stderr,
        flush=True,
    )
    return failure.exitcode if failure.exitcode > 0 else 1


# Exit statuses whose worker's message is one line meant for people (see distributed.failures).
SAID_AS_IT_IS = (EXIT_USAGE, EXIT_HANG, EXIT_REQUEUE, EXIT_RUN_DIR_LOST)


def _written_by_worker(failure: ProcessFailure) -> bool:
    """Whether the worker wrote its failure to torchrun's error file (a line or a traceback); without one,
    torch makes up a message of its own (a link to its docs, the signal's number)."""
    from torch.distributed.elastic.multiprocessing import errors

    return failure.error_file != getattr(errors, "_NOT_AVAILABLE", "<N/A>")


def _quiet_elastic_logs() -> None:
    # The elastic agent narrates every restart and shutdown at WARNING; dtrain reports failures
    # itself. DTRAIN_VERBOSE=1 brings the agent's own account back.
    if not os.environ.get("DTRAIN_VERBOSE"):
        import torch.distributed.run  # noqa: F401 — its modules' loggers exist from here on

        prefixes = ("torch.distributed.elastic", "torch.distributed.run")
        # Each of torch's elastic modules sets its own logger's level (elastic.utils.logging), so the
        # parent's level alone does not quiet them ("Received 2 death signal, shutting down workers").
        names = [name for name in logging.root.manager.loggerDict if name.startswith(prefixes)]
        for name in {*prefixes, *names}:
            logging.getLogger(name).setLevel(logging.CRITICAL)
