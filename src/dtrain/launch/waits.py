"""What the launcher waits for before its workers exist, said out loud and given up in one line: the
rendezvous endpoint (its name resolving, something listening), rank 0's store for a worker a pod, srun
or mpirun started, and the other nodes while torchrun's rendezvous waits for them in C++."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from typing import TYPE_CHECKING

from dtrain import distributed
from dtrain.distributed import netaddr
from dtrain.distributed.waiting import WaitReport
from dtrain.errors import EnvironmentProblem

if TYPE_CHECKING:
    from dtrain.launch import LaunchSpec


class EndpointWait:
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


def own_address(spec: LaunchSpec, wait: EndpointWait | None) -> tuple[str | None, bool]:
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


def wait_for_rank0(env: distributed.DistEnv, timeout: float) -> None:
    """A worker started by something else (a pod's RANK/WORLD_SIZE, srun, mpirun) other than rank 0
    waits, visibly, until rank 0's store at MASTER_ADDR:MASTER_PORT answers."""
    if env.world_size > 1 and env.rank != 0:
        wait = EndpointWait(
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


def peers_report(spec: LaunchSpec) -> WaitReport | contextlib.nullcontext:
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
