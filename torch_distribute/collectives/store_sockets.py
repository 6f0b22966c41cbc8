"""Wake this process's calls blocked on a TCP peer that never answers, by shutting down the
sockets connected to it (Linux: read from ``/proc``).

A worker whose chief is stopped (SIGSTOP) or cut off has threads blocked in torch's store
client (C++) waiting for answers that never come. One that returns while the interpreter
finalizes aborts the process, so at exit those calls must end first. ``shutdown(2)`` of a
connected socket makes a ``recv`` blocked on it (in any thread) return at once, so the store
call raises in its own thread, which then ends normally, and the process exits with the
status its program asked for (``sys.exit(n)``), which no exit handler can see.

>>> shut_down_connections_to([], 29500)  # no address to look for: nothing shut down
0
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterable

_TABLES = ("/proc/self/net/tcp", "/proc/self/net/tcp6")


def addresses_of(host: str) -> list[str]:
    """The IP addresses ``host`` resolves to (itself if it is one); empty if it does not."""
    try:
        return sorted({str(info[4][0]) for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)})
    except (OSError, UnicodeError):
        return []


def _remote_inodes(addresses: Iterable[str], port: int) -> set[str]:
    """Socket inodes of this process's TCP connections to one of ``addresses`` at ``port``."""
    wanted = set()
    for address in addresses:
        ip = ipaddress.ip_address(address)
        wanted.add(ip)
        if ip.version == 4:
            wanted.add(ipaddress.IPv6Address(f"::ffff:{address}"))
    inodes = set()
    for table in _TABLES:
        try:
            with open(table) as rows:
                next(rows, None)
                for row in rows:
                    fields = row.split()
                    remote_hex, remote_port_hex = fields[2].split(":")
                    if int(remote_port_hex, 16) != port:
                        continue
                    raw = bytes.fromhex(remote_hex)
                    # /proc prints each 32-bit word in host (little-endian) order.
                    packed = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                    if ipaddress.ip_address(packed) in wanted:
                        inodes.add(fields[9])
        except (OSError, ValueError, IndexError):
            continue
    return inodes


def shut_down_connections_to(addresses: Iterable[str], port: int) -> int:
    """``shutdown(SHUT_RDWR)`` every socket of this process connected to ``addresses:port``;
    how many. Only where ``/proc`` lists them (Linux); 0 elsewhere."""
    inodes = _remote_inodes(addresses, port)
    if not inodes:
        return 0
    count = 0
    try:
        descriptors = os.listdir("/proc/self/fd")
    except OSError:
        return 0
    for name in descriptors:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if not (target.startswith("socket:[") and target[8:-1] in inodes):
            continue
        try:
            # A duplicate, so that closing our socket object leaves torch's descriptor open;
            # shutdown acts on the connection, which both share.
            duplicate = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        try:
            duplicate.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:
            pass
        finally:
            duplicate.close()
    return count
