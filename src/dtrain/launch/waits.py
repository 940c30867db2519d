"""What the launcher waits for before its workers exist, said out loud and given up in one line: the
rendezvous endpoint's name resolving (the wait for something listening there is distributed.waiting's,
shared with a worker waiting for rank 0), and the other nodes while torchrun's rendezvous waits for them
in C++."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from typing import TYPE_CHECKING

from dtrain.distributed import netaddr
from dtrain.distributed.waiting import EndpointWait, WaitReport
from dtrain.errors import EnvironmentProblem

if TYPE_CHECKING:
    from dtrain.launch import LaunchSpec


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
