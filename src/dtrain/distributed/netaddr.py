"""This node's own address, worked out from the route to the rendezvous endpoint.

Inside containers and network namespaces the hostname often resolves to 127.0.0.1. Left to itself,
torchrun then tells the other nodes to reach this one at loopback (they hang), the endpoint node does
not recognise the endpoint address as its own (it never starts the store), and gloo binds loopback.
The address this node uses to reach the endpoint is the one the others can reach it at.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import socket
import struct

_SIOCGIFADDR = 0x8915


def resolve(host: str) -> str:
    return socket.gethostbyname(host)


def address_toward(target_ip: str) -> str:
    """The local IPv4 address the kernel would use to reach `target_ip` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((target_ip, 9))
        return s.getsockname()[0]


def interface_addresses() -> dict[str, str]:
    """IPv4 address of each network interface that has one (Linux)."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def interface_of(address: str) -> str | None:
    return next((name for name, addr in interface_addresses().items() if addr == address), None)


def node_address(endpoint_host: str) -> tuple[str, bool]:
    """(this node's address toward the endpoint, whether the endpoint is this node). OSError when no
    node could ever serve the endpoint: an address no interface can hold, or no route to it."""
    target = resolve(endpoint_host)
    kind = _never_a_node(target)
    if kind:  # the kernel would route some of these (0.0.0.0 to this node): a wait with no end
        raise OSError(errno.EADDRNOTAVAIL, f"{target} is {kind}, never a node's address")
    local = address_toward(target)
    return local, target == local or target in interface_addresses().values()


def _never_a_node(address: str) -> str | None:
    ip = ipaddress.ip_address(address)
    if ip.is_unspecified:
        return "the unspecified address"
    if ip.is_multicast:
        return "a multicast address"
    if ip.is_reserved:  # 240.0.0.0/4, the broadcast address among them
        return "a reserved address"
    return None
