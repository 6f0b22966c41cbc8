"""Which local network interface reaches another host (for Gloo's choice of interface).

Gloo binds to the address its host name resolves to unless ``GLOO_SOCKET_IFNAME`` names an
interface. On many machines the host name resolves to a loopback address, so a job that
spans hosts fails to connect (``Connection refused`` at ``127.0.x.x``). The interface whose
address the kernel would use to reach the chief is the one every worker can be reached on.

>>> interface_towards("127.0.0.1") in (None, "lo")
True
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import struct

_SIOCGIFADDR = 0x8915  # Linux: read an interface's IPv4 address


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and for loopback addresses (the job stays on this machine)."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def interface_towards(host: str, port: int = 9) -> str | None:
    """The name of the interface this machine would use to reach ``host``; None if unknown.

    No packet is sent: connecting a UDP socket only asks the kernel for a route.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(host), port))
            local = probe.getsockname()[0]
    except OSError:
        return None
    for _index, name in _interfaces():
        if _ipv4_of(name) == local:
            return name
    return None


def _interfaces() -> list[tuple[int, str]]:
    try:
        return socket.if_nameindex()
    except OSError:  # no such call on this platform
        return []


def _ipv4_of(name: str) -> str | None:
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        return None
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("256s", name.encode()[:15])
        return socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)[20:24])
    return None
