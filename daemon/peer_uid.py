"""Which local user is at the other end of a loopback TCP connection (Linux).

The kernel lists every TCP socket of this network namespace in /proc/net/tcp and /proc/net/tcp6,
with the uid that owns it. The client's end of a connection to us is the entry whose local
address is the peer address we see and whose remote address is ours; its uid is the client's.
Elsewhere there is no such table, and `peer_uid` answers None.
"""

from __future__ import annotations

import ipaddress
import socket
import sys
from pathlib import Path

TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
ESTABLISHED = "01"

Address = tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]


def parse_address(text: str) -> Address:
    """`0100007F:1F90` (the kernel's hex: 32-bit words in host byte order, port big-endian)."""
    host, _, port = text.partition(":")
    raw = bytes.fromhex(host)
    # Each 32-bit word is printed as a native integer: on a little-endian host, reversed bytes.
    order = sys.byteorder
    packed = b"".join(int.from_bytes(raw[i:i + 4], order).to_bytes(4, "big")
                      for i in range(0, len(raw), 4))
    ip = ipaddress.IPv4Address(packed) if len(packed) == 4 else ipaddress.IPv6Address(packed)
    return ip, int(port, 16)


def plain_ip(ip: ipaddress.IPv4Address | ipaddress.IPv6Address):
    """An IPv4-mapped IPv6 address (::ffff:127.0.0.1) as the IPv4 address it carries."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def find_uid(table_text: str, peer: Address, ours: Address) -> int | None:
    """The uid of the established socket whose local end is `peer` and remote end `ours`
    (pure: the text of one /proc/net/tcp* file)."""
    want_peer = (plain_ip(peer[0]), peer[1])
    want_ours = (plain_ip(ours[0]), ours[1])
    for line in table_text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 8 or fields[3] != ESTABLISHED:
            continue
        try:
            local, remote = parse_address(fields[1]), parse_address(fields[2])
            uid = int(fields[7])
        except ValueError:
            continue
        if ((plain_ip(local[0]), local[1]) == want_peer
                and (plain_ip(remote[0]), remote[1]) == want_ours):
            return uid
    return None


def peer_uid(sock: socket.socket) -> int | None:
    """The uid owning the other end of a loopback TCP connection, or None when it cannot be
    told (not Linux, not loopback, or the connection is already gone)."""
    try:
        peer_host, peer_port = sock.getpeername()[:2]
        our_host, our_port = sock.getsockname()[:2]
        peer = (ipaddress.ip_address(peer_host.partition("%")[0]), peer_port)
        ours = (ipaddress.ip_address(our_host.partition("%")[0]), our_port)
    except (OSError, ValueError):
        return None
    if not plain_ip(peer[0]).is_loopback:
        return None
    for table in TABLES:
        try:
            text = table.read_text()
        except OSError:
            continue
        uid = find_uid(text, peer, ours)
        if uid is not None:
            return uid
    return None
