"""Start workers through torch's own elastic launcher (torchrun), in this process.

dtrain never forks or watches workers itself: it turns its flags into torchrun's, gives the workers a
sensible thread count, runs the elastic agent, and turns a failed group into one clear report.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dtrain import distributed, early_stop
from dtrain.distributed import netaddr
from dtrain.distributed.waiting import WaitReport
from dtrain.errors import EXIT_HANG, EXIT_REQUEUE, EXIT_USAGE, ConfigError, EnvironmentProblem

if TYPE_CHECKING:
    from types import FrameType

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

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


def torchrun_args(
    spec: LaunchSpec, entry: list[str], local_addr: str | None = None, is_host: bool = False
) -> list[str]:
    """The torchrun command line (without 'torchrun') for `spec`, running `entry` in each worker."""
    args = [
        f"--nproc-per-node={spec.nproc}",
        f"--max-restarts={spec.max_restarts}",
        f"--shutdown-timeout={int(spec.shutdown_grace_s)}",
    ]
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
        args.append(f"--rdzv-conf=join_timeout={int(spec.rdzv_timeout)}" + (",is_host=1" if is_host else ""))
    if local_addr:
        args.append(f"--local-addr={local_addr}")
    return args + entry


class _Wait:
    """Waiting for the rendezvous endpoint until a deadline: said after a moment and then at a slow
    pace (`WaitReport`), given up in one line. `server` is who serves the endpoint; `knob` what sets
    the wait, `knobs` what sets the address and the wait."""

    def __init__(
        self,
        endpoint: str,
        timeout: float,
        server: str = "the first node",
        knob: str = "--rdzv-timeout",
        knobs: str = "--rdzv-timeout sets the wait",
    ):
        self.endpoint, self.timeout, self.server, self.knob, self.knobs = endpoint, timeout, server, knob, knobs
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
            raise EnvironmentProblem(
                f"nothing answered at {self.endpoint} for {self.timeout:g} s ({reason}): start "
                f"{start} at that address, or check the address, the port and the firewall "
                f"({self.knobs})"
            )
        self._report.start()
        time.sleep(min(1.0, max(0.0, self.deadline - time.monotonic())))

    def over(self) -> None:
        self._report.stop()


def _own_address(spec: LaunchSpec, wait: _Wait | None) -> tuple[str | None, bool]:
    """This node's address and whether it hosts the rendezvous (multi-node only). An endpoint whose
    name does not resolve yet (a Kubernetes service, a SLURM head node starting) is waited for."""
    if not spec.rdzv_endpoint or wait is None:
        return spec.local_addr, False
    host = spec.rdzv_endpoint.rpartition(":")[0]
    while True:
        try:
            local, is_host = netaddr.node_address(host)
            break
        except socket.gaierror as exc:
            wait.again(f"{host} does not resolve: {exc.strerror}")
        except OSError as exc:
            # No route, or no node could have the address: no wait would ever end.
            raise EnvironmentProblem(
                f"--rdzv-endpoint {spec.rdzv_endpoint} cannot be reached from this node "
                f"({exc.strerror or exc}): give an address of the first node that every node can reach"
            ) from None
    if spec.local_addr:
        try:
            is_host = is_host or netaddr.resolve(host) == netaddr.resolve(spec.local_addr)
        except OSError as exc:
            raise EnvironmentProblem(
                f"--local-addr {spec.local_addr} does not resolve ({exc.strerror or exc}); give "
                f"this node's address as the other nodes reach it"
            ) from None
        local = spec.local_addr
    return local, is_host


def wait_for_endpoint(wait: _Wait) -> None:
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


def wait_for_rank0(env: distributed.DistEnv, timeout: float) -> None:
    """A worker started by something else (a pod's RANK/WORLD_SIZE, srun, mpirun) other than rank 0
    waits, visibly, until rank 0's store at MASTER_ADDR:MASTER_PORT answers."""
    if env.world_size > 1 and env.rank != 0:
        wait = _Wait(
            f"{env.master_addr}:{env.master_port}",
            timeout,
            server="rank 0",
            knob="distributed.timeout_s",
            knobs="MASTER_ADDR and MASTER_PORT set the address, distributed.timeout_s the wait",
        )
        try:
            wait_for_endpoint(wait)
        finally:
            wait.over()


def _peers_report(spec: LaunchSpec) -> WaitReport | contextlib.nullcontext:
    """While torchrun's rendezvous waits for the other nodes (in C++, silent), say so: under c10d how
    many are still missing, read from the rendezvous state in the store at the endpoint; under the
    static rendezvous (--node-rank) node 0's store counts them out of reach, so only that it waits.
    Over once the group formed. A static node other than 0 only connects, waited for beforehand."""
    if not spec.multi_node or spec.node_rank not in (None, 0) or not spec.rdzv_endpoint:
        return contextlib.nullcontext()
    endpoint, deadline = spec.rdzv_endpoint, time.monotonic() + spec.rdzv_timeout

    def line() -> str | None:
        if spec.node_rank is None:
            joined = _rendezvous_joined(endpoint, spec.rdzv_id)
        else:
            joined = True if _workers_started() else None
        if joined is True:
            return None  # the group formed: the workers start
        if deadline - time.monotonic() < 1:  # torch gives up a moment after the deadline, and says so
            return ""
        left = f"giving up in {deadline - time.monotonic():.0f} s (--rdzv-timeout)"
        if joined is None:  # the state cannot be read: say what is known
            return f"waiting for the other nodes at {endpoint} (--nnodes {spec.nnodes}), {left}"
        missing = spec.min_nodes - joined
        if missing <= 0:
            return ""  # enough nodes: an elastic range waits a last call for more, then starts
        nodes = f"{missing} more node{'s' if missing > 1 else ''}"
        return f"waiting for {nodes} at {endpoint} (--nnodes {spec.nnodes}), {left}"

    return WaitReport(line)


def _workers_started() -> bool:
    """Whether this launcher has a child process yet: torchrun starts the workers once the group formed."""
    me = str(os.getpid())
    for entry in os.scandir("/proc"):
        try:
            with open(f"/proc/{entry.name}/stat") as stat:  # "PID (COMM) STATE PPID ..."
                if entry.name.isdigit() and stat.read().rpartition(")")[2].split()[1] == me:
                    return True
        except (OSError, IndexError):
            continue  # gone meanwhile, or not a process
    return False


def _rendezvous_joined(endpoint: str, run_id: str) -> int | bool | None:
    """How many nodes have joined the c10d rendezvous `run_id` at `endpoint` so far; True once it is
    complete; None when its state cannot be read. The state is the one torch's C10dRendezvousBackend
    keeps in the store: a pickled _RendezvousState, base64-encoded, under torch.rendezvous.RUN_ID."""
    import datetime
    import pickle
    from base64 import b64decode

    from torch.distributed import TCPStore

    host, _, port = endpoint.rpartition(":")
    key = f"torch.rendezvous.{run_id}"
    try:
        store = TCPStore(
            host.strip("[]"), int(port), is_master=False, timeout=datetime.timedelta(seconds=5), wait_for_workers=False
        )
        if not store.check([key]):
            return 0
        raw = store.get(key)
        if raw == b"Y2FuaW1hZGFt":  # the backend's "no state yet"
            return 0
        state = pickle.loads(b64decode(raw))
    except Exception:  # any failure: the count is unknown, not fatal
        return None
    return True if state.complete else len(state.participants)


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
    wait = _Wait(spec.rdzv_endpoint, spec.rdzv_timeout) if spec.rdzv_endpoint else None
    try:
        local_addr, is_host = _own_address(spec, wait)
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
    _sigterm_once()
    _signals_reach_a_joining_node()
    args = get_args_parser().parse_args(torchrun_args(spec, entry, local_addr, is_host))
    try:
        with _peers_report(spec):  # over before any line below: the give-up line comes last
            run(args)
        return 0
    except ChildFailedError as exc:
        return _print_first_failure(exc)
    except SignalException as exc:
        # The workers got the signal too; on SIGTERM they wrote a checkpoint and said so.
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


def _sigterm_once() -> None:
    """Have the elastic agent act on the first SIGTERM only. Its handler raises SignalException on
    every one; the first starts the shutdown (SIGTERM to the workers, `checkpoint.preempt_grace_s` for
    their checkpoint, then SIGKILL), and a repeat during that wait — a scheduler saying it again, an
    impatient user — would abort it: the launcher would exit and its workers die with it
    (`die_with_the_launcher`), mid-checkpoint. torch installs the handler by this module-level name
    when it starts the workers."""
    from torch.distributed.elastic.multiprocessing import api

    raise_signal = api._terminate_process_handler
    if getattr(raise_signal, "dtrain_once", False):
        return
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        if signum == signal.SIGTERM:
            if stopping:
                return  # the workers were told; the grace runs from the first
            stopping = True
            _mark_stopping()
        raise_signal(signum, frame)

    on_signal.dtrain_once = True  # type: ignore[attr-defined]
    api._terminate_process_handler = on_signal


def _mark_stopping() -> None:
    """Tell this launcher's workers that the SIGTERM they are about to get is a preemption (see
    early_stop.launcher_stopping_mark); the mark goes when the launcher does."""
    import atexit

    mark = early_stop.launcher_stopping_mark(os.getpid())
    with contextlib.suppress(OSError):
        mark.touch()
        atexit.register(lambda: mark.unlink(missing_ok=True))


def _signals_reach_a_joining_node(patience_s: float = 1.0) -> None:
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
            if signum == signal.SIGTERM:
                with contextlib.suppress(Exception):
                    print(f"dtrain: {early_stop.NOTHING_TO_SAVE}", file=sys.stderr, flush=True)
                os._exit(EXIT_REQUEUE)
            os._exit(128 + signal.SIGINT)

    threading.Thread(target=watch, name="dtrain-signals-while-joining", daemon=True).start()


def _print_first_failure(exc: ChildFailedError) -> int:
    """Print the first failure once: a bad-input or hang line as it is, a crash with its rank and
    traceback."""
    rank, failure = exc.get_first_failure()
    for code in (EXIT_USAGE, EXIT_HANG):  # already one line meant for people: print it as it is
        said = next((f for f in exc.failures.values() if f.exitcode == code), None)
        if said is not None:
            print(f"dtrain: error: {said.message}", file=sys.stderr, flush=True)
            return code
    requeue = [f for f in exc.failures.values() if f.exitcode == EXIT_REQUEUE]
    if requeue:  # workers stopped by a SIGTERM of their own (not the launcher's)
        line = next((f.message for f in requeue if f.message and "pytorch.org/docs" not in f.message), None)
        if line:  # before training (early_stop); after it, rank 0 said where its checkpoint is
            print(f"dtrain: {line}", file=sys.stderr, flush=True)
        return EXIT_REQUEUE
    if failure.exitcode < 0:
        what = f"was killed by {failure.signal_name()}"
    else:
        what = f"exited with status {failure.exitcode}"
    detail = failure.message if failure.message and "pytorch.org/docs" not in failure.message else ""
    print(
        f"dtrain: error: rank {rank} (local rank {failure.local_rank}) {what}" + (f":\n{detail}" if detail else ""),
        file=sys.stderr,
        flush=True,
    )
    return 1


def _quiet_elastic_logs() -> None:
    # The elastic agent narrates every restart and shutdown at WARNING; dtrain reports failures
    # itself. DTRAIN_VERBOSE=1 brings the agent's own account back.
    if not os.environ.get("DTRAIN_VERBOSE"):
        for name in ("torch.distributed.elastic", "torch.distributed.run"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
